"""Triton kernels vs their torch ``_ref`` twins on CUDA (random inputs, poisoned pools and outputs,
relative error bounds by dtype; see kernel_cases.py).  The public dispatch functions are called,
so these also check that CUDA tensors are routed to the Triton kernels."""
import functools
import logging
import math

import pytest
import torch

import attention_cases as ac
import kernel_cases as kc
import ssd_pooled_cases as spc
from hybrid_engine.attention import ops as attn_ops
from hybrid_engine.mamba_cache.ops import (causal_conv1d_update, causal_conv1d_varlen, gated_rmsnorm,
                             selective_state_update, ssd_scan_varlen, ssd_scan_varlen_pooled)
from hybrid_engine.mamba_cache.ops import triton_common

pytestmark = pytest.mark.gpu

DEV = "cuda"
F32 = torch.float32
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DT_IDS = ["f32", "bf16", "f16"]


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)


# ----------------------------------------------------------------------------- dispatch

def test_dispatch_picks_triton_and_logs_once(caplog):
    triton_common._logged.clear()
    attn_ops._logged_backends.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        for _ in range(2):
            kc.check_norm(gated_rmsnorm, DEV, torch.bfloat16, 3, 64, 32)
            kc.check_conv_update(causal_conv1d_update, DEV, torch.bfloat16, 3, 2, 32, K=1)
            kc.check_conv_varlen(causal_conv1d_varlen, DEV, torch.bfloat16, [3, 2], 32)
            kc.check_ssu(selective_state_update, DEV, torch.bfloat16, 3, 2, 1)
            kc.check_ssd(ssd_scan_varlen, DEV, torch.bfloat16, [3, 20])
            ac.check_attention(attn_ops.paged_attention, DEV, torch.bfloat16, [1, 2], [3, 4])
    msgs = [r.getMessage() for r in caplog.records]
    for op in ("gated_rmsnorm", "causal_conv1d_update", "causal_conv1d_varlen",
               "selective_state_update", "ssd_scan_varlen", "paged_attention"):
        mine = [m for m in msgs if m.startswith(op + " backend")]
        assert mine == [f"{op} backend on cuda: triton"], (op, mine)


# ----------------------------------------------------------------------------- conv varlen

CONV_VARLEN = [
    dict(lens=[5, 1, 0, 2, 17], C=24, W=4, K=0),
    dict(lens=[1], C=40, W=4, K=3),
    dict(lens=[300, 1, 2, 129], C=200, W=3, K=8, bias=False),
    dict(lens=[2, 1, 1], C=64, W=2, K=1),
    dict(lens=[0, 0, 3], C=16, W=4, K=2),
    dict(lens=[1000, 37], C=10240, W=4, K=3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", range(len(CONV_VARLEN)))
def test_conv_varlen(dtype, case):
    for seed in (0, 1):      # seed 0: MambaPool's token-major layout; seed 1: channel-major
        kc.check_conv_varlen(causal_conv1d_varlen, DEV, dtype, seed=seed, token_major=seed == 0,
                             **CONV_VARLEN[case])


# ----------------------------------------------------------------------------- conv update

CONV_UPDATE = [
    dict(N=1, s=1, C=32, K=0),
    dict(N=5, s=1, C=48, K=3),
    dict(N=7, s=4, C=40, K=3),
    dict(N=4, s=9, C=24, K=8),
    dict(N=3, s=2, C=24, K=5, W=2),
    dict(N=33, s=3, C=200, K=8, W=3, bias=False),
    dict(N=64, s=4, C=10240, K=3),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", range(len(CONV_UPDATE)))
def test_conv_update(dtype, case):
    for seed in (0, 1):      # seed 0: MambaPool's token-major layout; seed 1: channel-major
        kc.check_conv_update(causal_conv1d_update, DEV, dtype, seed=seed, token_major=seed == 0,
                             **CONV_UPDATE[case])


@pytest.mark.parametrize("K", range(9))
def test_conv_update_all_k(K):
    for s in sorted({1, K + 1}):
        kc.check_conv_update(causal_conv1d_update, DEV, torch.bfloat16, 6, s, 72, K=K, seed=K)


# selectable variants of triton_causal_conv1d_update (the cols kernel; benchmarks/kernels.py
# --sweep-conv times them): each on a subset of CONV_UPDATE, both pool layouts
CONV_UPDATE_VARIANTS = [
    dict(variant="window"),                        # the previous kernel
    dict(variant="window", block_c=256, num_warps=4),
    dict(variant="cols", cache_hints="none"),
    dict(rows_per_program=2),
    dict(rows_per_program=4, block_c=256, num_warps=4),
    dict(rows_per_program=8, block_c=1024, num_warps=16),
    dict(rows_per_program=2, block_c=512, num_warps=2, weight_load="taps"),
    dict(block_c=64, num_warps=1, weight_load="flat"),
    dict(rows_per_program=2, inputs_first=True),
    dict(cache_hints="evict"),
    dict(rows_per_program=2, cache_hints="cg+cs"),
    dict(cache_hints="evict+cg+cs"),
    dict(rows_per_program=2, channels_fast=True),
    dict(pdl=1),
    dict(rows_per_program=2, pdl=2, inputs_first=True, cache_hints="evict"),
]
CONV_UPDATE_VARIANT_CASES = [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("case", CONV_UPDATE_VARIANT_CASES)
@pytest.mark.parametrize("variant", range(len(CONV_UPDATE_VARIANTS)))
def test_conv_update_variants(variant, case):
    from hybrid_engine.mamba_cache.ops.triton_conv_update import triton_causal_conv1d_update
    impl = functools.partial(triton_causal_conv1d_update, **CONV_UPDATE_VARIANTS[variant])
    for seed in (0, 1):      # seed 0: MambaPool's token-major layout; seed 1: channel-major
        kc.check_conv_update(impl, DEV, torch.bfloat16, seed=seed, token_major=seed == 0,
                             **CONV_UPDATE[case])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("opts", [dict(variant="cols"), dict(rows_per_program=4)],
                         ids=["cols", "rows4"])
def test_conv_update_variant_dtypes_all_k(dtype, opts):
    from hybrid_engine.mamba_cache.ops.triton_conv_update import triton_causal_conv1d_update
    impl = functools.partial(triton_causal_conv1d_update, **opts)
    for K in range(9):
        for s in sorted({1, K + 1}):
            kc.check_conv_update(impl, DEV, dtype, 6, s, 72, K=K, seed=K, token_major=K % 2 == 0)


@pytest.mark.parametrize("weight_load", ["auto", "flat", "taps"])
def test_conv_update_variant_widths(weight_load):
    """Conv widths 2..8 through both weight loads (flat: W in 2, 4, 8)."""
    from hybrid_engine.mamba_cache.ops.triton_conv_update import triton_causal_conv1d_update
    for W in (2, 3, 4, 5, 8):
        if weight_load == "flat" and W not in (2, 4, 8):
            continue
        for rows, bc, nw in ((1, None, None), (2, 64, 1), (4, 256, 2)):
            impl = functools.partial(triton_causal_conv1d_update, weight_load=weight_load,
                                     rows_per_program=rows, block_c=bc, num_warps=nw)
            for dtype in (torch.float32, torch.bfloat16):
                kc.check_conv_update(impl, DEV, dtype, 9, 3, 136, W=W, K=2, seed=W + rows,
                                     token_major=rows != 2)


@pytest.mark.parametrize("opts", [{}, dict(variant="cols"), dict(rows_per_program=2),
                                  dict(rows_per_program=2, num_warps=2)],
                         ids=["default", "cols", "rows2", "rows2_nw2"])
def test_conv_update_tap_major_weight(opts):
    """A [C, W] weight view of [W, C] storage (vector loads per tap)."""
    from hybrid_engine.mamba_cache.ops.triton_conv_update import triton_causal_conv1d_update
    impl = functools.partial(triton_causal_conv1d_update, **opts)
    for case in (2, 5, 6):
        kc.check_conv_update(impl, DEV, torch.bfloat16, tap_major_weight=True, **CONV_UPDATE[case])


# ----------------------------------------------------------------------------- ssd

SSD = [
    dict(lens=[16, 1, 0, 35, 7], chunk_size=16),
    dict(lens=[64, 64], H=8, G=1, P=8, N=32, chunk_size=64),
    dict(lens=[1], chunk_size=16),
    dict(lens=[200, 3, 129], H=4, G=4, P=64, N=128, chunk_size=128),
    dict(lens=[17] * 8, chunk_size=16, dt_limit=(0.0, 0.5)),
    dict(lens=[40, 33], H=6, G=3, P=24, N=24, chunk_size=32),
    dict(lens=[1000], H=16, G=2, P=64, N=128, chunk_size=256, dt_limit=(0.001, 0.1)),
    dict(lens=[5, 70, 0], chunk_size=32, qsl_on_device=False),
    dict(lens=[0, 40, 0], H=2, G=1, P=16, N=128, chunk_size=16),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", range(len(SSD)))
def test_ssd(dtype, case):
    # y in float32 through the public op (steps 2 and 3 fused: the default), then in the model
    # dtype (what the model asks for) with the two unfused kernels
    from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen
    for seed, impl in enumerate((ssd_scan_varlen, functools.partial(triton_ssd_scan_varlen, fused_pass=False))):
        kc.check_ssd(impl, DEV, dtype, seed=seed, out_dtype=(F32, dtype)[seed], **SSD[case])


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_ssd_pooled(dtype):
    """The mixer's form: the state pass reads and writes the pool by slot (fresh rows read zeros
    over NaN slots, NULL_SLOT rows write nothing), with and without prefix-cache emits, on the
    multi-head (16-bit) and per-head kernels."""
    spc.check_ssd_pooled(ssd_scan_varlen_pooled, DEV, dtype, [16, 1, 35, 7, 9, 4], fresh=(1, 2, 5), null_rows=(4, 5))
    spc.check_ssd_pooled(ssd_scan_varlen_pooled, DEV, dtype, [300, 40], fresh=(0,), H=16, G=2, P=64, N=128,
                        chunk_size=128, emit=[0, 127, 128, 299, 300, 339], seed=1, step_layout=True)
    # the unfused chunk-state and state-pass kernels (the default fuses them), then the fused
    # kernel on sequences of many chunks
    from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen_pooled
    # and the emits stored by the fused pass itself (fused_emits)
    for opts, lens, cs in ((dict(fused_pass=False), [300, 40], 128), (dict(fused_pass=True), [700, 9, 33], 32),
                           (dict(fused_pass=True, fused_emits=True), [300, 40, 33], 128)):
        spc.check_ssd_pooled(functools.partial(triton_ssd_scan_varlen_pooled, **opts), DEV, dtype, lens,
                            fresh=(1,), H=16, G=2, P=64, N=128, chunk_size=cs, emit=[0, 127, 128, 299, 300, 339],
                            seed=2, step_layout=True)


SSD_VARIANT_CASES = [SSD[0], SSD[3], SSD[6]]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("lowp,cb_pre", [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("case", range(len(SSD_VARIANT_CASES)))
def test_ssd_variants(dtype, lowp, cb_pre, case):
    """lowp / cb_pre combinations and block shapes (16-bit models with lowp: the multi-head
    kernel where a group has several heads; otherwise the per-head kernel)."""
    from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen
    for seed, (bm, bk, nw, bp, st) in enumerate([(None, None, None, None, None),
                                                  (64, 64, 8, None, None), (64, 32, 4, 32, 3)]):
        impl = functools.partial(triton_ssd_scan_varlen, lowp=lowp, cb_pre=cb_pre, block_m=bm,
                                 block_k=bk, num_warps=nw, block_p=bp, num_stages=st)
        kc.check_ssd(impl, DEV, dtype, seed=seed, out_dtype=(F32, dtype)[seed % 2],
                     **SSD_VARIANT_CASES[case])


# chunk-output options (triton_ssd_scan_varlen docstring).  bf16 / fp16 models run the multi-head
# kernel by default (test_ssd covers it: 2 / 8 heads per group, chunks 16..256, and the per-head
# fallback for one head per group); float32 models the per-head kernel.  Here: the per-head
# kernel on 16-bit models (heads_per_program=1) with C.B precomputed in the model dtype; the
# multi-head kernel with 2 / 4 / 8 heads per program on 3 / 6 / 8 heads per
# group (blocks cut short), C.B in float32 or precomputed; each option on two shapes (float32
# models run the multi-head kernel on the chunks <= 64 only: the per-head kernel above that)
SSD_OUT_CASES = [
    SSD[0],                                                                     # hpg 2, cs 16
    dict(lens=[40, 33, 0, 65], H=6, G=2, P=24, N=24, chunk_size=32),            # hpg 3, cs 32
    dict(lens=[70, 1, 129], H=12, G=2, P=32, N=64, chunk_size=64),              # hpg 6, cs 64
    dict(lens=[300, 5, 0, 129], H=12, G=2, P=64, N=128, chunk_size=128),        # hpg 6, cs 128
    SSD[6],                                                                     # hpg 8, cs 256
    dict(lens=[700, 9, 0, 33], H=6, G=2, P=24, N=24, chunk_size=32),            # 22 chunks
]
SSD_OUT_OPTIONS = [      # (options, SSD_OUT_CASES indices)
    (dict(), (1, 3)),
    (dict(heads_per_program=1), (1, 4)),
    (dict(heads_per_program=1, cb_pre=True, cb_dtype="model", block_m=64, block_p=32), (0, 3)),
    (dict(heads_per_program=2, block_m=64, cb_dtype="float32"), (1, 3)),
    (dict(heads_per_program=4, cb_pre=True, cb_dtype="model"), (1, 2)),
    (dict(heads_per_program=8, block_m=128, num_warps=8, block_p=32), (2, 4)),
]


# chunk-state (step 2) options (triton_ssd_scan_varlen docstring): K step, P block (P = 24 leaves
# masked columns), launch knobs, on 2 / 3 / 6 / 8 heads per group and chunks 16..256; they act on
# the unfused kernels only (fused_pass=False; the 8B shape fuses steps 2 and 3 by default)
SSD_OUT_OPTIONS += [
    (dict(state_block_k=16, fused_pass=False), (0, 1, 3)),
    (dict(state_block_k=64, fused_pass=False), (1, 2, 4)),
    (dict(state_block_k=32, state_num_warps=8, state_num_stages=3, fused_pass=False), (2, 3, 4)),
    (dict(state_block_p=32, state_num_stages=2, fused_pass=False), (0, 1, 3, 5)),
]
# steps 2 and 3 fused (triton_ssd_fused_pass, the default; test_ssd runs both paths on every case):
# its options (P = 24: masked columns; 22 chunks), and the unfused kernels with float32 dot
# operands on a 16-bit model (h_in in place over S)
SSD_OUT_OPTIONS += [
    (dict(fused_pass=False, lowp=False), (3, 5)),
    (dict(fused_pass=True, fused_block_p=16, fused_block_k=64, fused_num_warps=8), (1, 3, 5)),
    (dict(fused_pass=True, fused_block_p=64, fused_block_k=16), (0, 2)),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("opt", range(len(SSD_OUT_OPTIONS)))
def test_ssd_options(dtype, opt):
    from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen
    opts, cases = SSD_OUT_OPTIONS[opt]
    impl = functools.partial(triton_ssd_scan_varlen, **opts)
    for seed, case in enumerate(cases):
        kc.check_ssd(impl, DEV, dtype, seed=seed, out_dtype=(F32, dtype)[seed % 2],
                     **SSD_OUT_CASES[case])


# ----------------------------------------------------------------------------- state update

@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("K", range(9))
def test_ssu_all_k(dtype, K):
    for s in sorted({1, K + 1, max(1, K // 2)}):
        kc.check_ssu(selective_state_update, DEV, dtype, 5, s, K, seed=K + s)


SSU = [
    dict(N=1, s=1, K=0),
    dict(N=6, s=3, K=4, dt_limit=(0.01, 0.3)),
    dict(N=4, s=2, K=2, H=6, G=3, P=24, Nst=24),
    dict(N=16, s=4, K=3, H=128, G=8, P=64, Nst=128),
    dict(N=3, s=1, K=0, H=128, G=8, P=64, Nst=128),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", range(len(SSU)))
def test_ssu(dtype, case):
    for seed in (0, 1):      # y in float32, then in the model dtype (what the model asks for)
        kc.check_ssu(selective_state_update, DEV, dtype, seed=seed, out_dtype=(F32, dtype)[seed],
                     **SSU[case])


# (the state update fused with the gated norm: test_kernels_ssu_norm.py)


# ----------------------------------------------------------------------------- gated norm

NORM = [(1, 64, 64), (7, 48, 12), (33, 8192, 1024), (5, 200, 40), (300, 1024, 128)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", range(len(NORM)))
def test_norm(dtype, case):
    T, I, gs = NORM[case]
    kc.check_norm(gated_rmsnorm, DEV, dtype, T, I, gs, seed=case)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("mode", ["norm_then_gate", "gate_only"])
def test_norm_falcon_modes(dtype, mode):
    kc.check_norm(gated_rmsnorm, DEV, dtype, 33, 2048, 256, seed=7, mode=mode)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("block_t,num_warps,streaming", [(1, 1, False), (1, 4, True), (2, 2, False),
                                                         (4, 8, True)])
def test_norm_launch_options(dtype, block_t, num_warps, streaming):
    from hybrid_engine.mamba_cache.ops.triton_norm import triton_gated_rmsnorm
    for case in (1, 2, 3, 4):
        T, I, gs = NORM[case]
        kc.check_norm(lambda *a: triton_gated_rmsnorm(*a, block_t=block_t, num_warps=num_warps,
                                                      streaming=streaming),
                      DEV, dtype, T, I, gs, seed=case)


# ----------------------------------------------------------------------------- attention

ATTN = ac.ATTN_CASES


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", range(len(ATTN)))
def test_attention(dtype, case):
    for seed in (0, 1):
        ac.check_attention(attn_ops.paged_attention, DEV, dtype, seed=seed, **ATTN[case])


@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("case", [0, 1, 2, 6])
def test_attention_splits(num_splits, case):
    """Decode/verify rows with the key-range split forced off, small and large."""
    from hybrid_engine.attention.triton_attention import triton_paged_attention
    impl = functools.partial(triton_paged_attention, num_splits=num_splits)
    for dtype in (torch.float32, torch.bfloat16):
        ac.check_attention(impl, DEV, dtype, seed=num_splits, **ATTN[case])


@pytest.mark.parametrize("case", [0, 1, 2, 6])
def test_attention_decode_splits_under_a_large_bound(case):
    """Decode / verify rows under a length bound of 262144 (a large ``max_model_len``): the default
    rule splits each row's keys by its own length, not the bound, and stays exact."""
    from hybrid_engine.attention.triton_attention import triton_paged_attention

    def impl(q, kc_, vc, qsl, sl, bt, scale, mq, ms, **k):
        return triton_paged_attention(q, kc_, vc, qsl, sl, bt, scale, mq, 262144, **k)
    for dtype in (torch.float32, torch.bfloat16):
        ac.check_attention(impl, DEV, dtype, seed=case, **ATTN[case])


# ----------------------------------------------------------------------------- misc

def test_ssd_sequential_variant():
    from hybrid_engine.mamba_cache.ops.triton_ssd_sequential import triton_ssd_scan_sequential
    for dtype in (torch.float32, torch.bfloat16):
        kc.check_ssd(triton_ssd_scan_sequential, DEV, dtype, [16, 1, 0, 35, 7], seed=3)
        kc.check_ssd(triton_ssd_scan_sequential, DEV, dtype, [300], H=8, G=2, P=64, N=128,
                     chunk_size=128, tol=kc.TOL["ssu"][dtype] * 10)


def test_nan_is_caught():
    """The checks themselves: a NaN where the reference is finite fails."""
    def bad(*a, **k):
        out = causal_conv1d_update(*a, **k)
        out[0, 0, 0] = math.nan
        return out
    with pytest.raises(AssertionError):
        kc.check_conv_update(bad, DEV, torch.float32, 4, 2, 16, K=1)
