"""Tiny cases of every Triton kernel, run on CPU under TRITON_INTERPRET=1 (set by the caller before
this process starts: Triton reads it at import).  Prints one line per case:
``CASE <name> OK <errors>`` or ``CASE <name> FAIL <message>``; exits 1 if any case failed.
float32 (and one float16 case): bf16 tl.dot is wrong in the interpreter."""
import functools
import os
import sys

import torch
from triton_interpret import case_main

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"
torch.set_num_threads(1)

import checkpoint_cases as cc  # noqa: E402
import kernel_cases as kc  # noqa: E402
import ssu_deferred_cases as sdc  # noqa: E402
import linear_cases as lc  # noqa: E402
import ssd_pooled_cases as spc  # noqa: E402
from hybrid_engine.models.skinny_linear import skinny_linear, skinny_linear_dot, skinny_linear_fma  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_conv import triton_causal_conv1d_varlen  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_conv_update import triton_causal_conv1d_update  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_conv_windows import triton_conv_windows_before  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_norm import triton_gated_rmsnorm  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen, triton_ssd_scan_varlen_pooled  # noqa: E402,E501
from hybrid_engine.mamba_cache.ops.triton_ssd_emit import emit_states  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_ssd_sequential import triton_ssd_scan_sequential  # noqa: E402
from hybrid_engine.mamba_cache.ops import selective_state_update_gated  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_state_update import (triton_selective_state_update,  # noqa: E402
                                                  triton_selective_state_update_gated)

F32 = torch.float32


def _on_triton(case):
    """Run case with every public op dispatching to its Triton kernel (CPU tensors included)."""
    from hybrid_engine.mamba_cache.ops import triton_common
    real = triton_common.kernel_backend
    triton_common.kernel_backend = lambda op, device: "triton"
    try:
        return case()
    finally:
        triton_common.kernel_backend = real


def check_ssd_emit(dtype, lens, emit, chunk_size=16, H=4, G=2, P=16, N=16, seed=0, **kw):
    """Prefix-cache emits: the states after packed tokens ``emit`` equal the torch scan's (and y /
    final are unchanged by asking for them)."""
    from hybrid_engine.mamba_cache.ops import ssd_scan_varlen_ref
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = torch.randn(T, H, P, generator=g).to(dtype)
    dt = (torch.randn(T, H, generator=g) * 0.5).to(dtype)
    B = torch.randn(T, G, N, generator=g).to(dtype)
    C = torch.randn(T, G, N, generator=g).to(dtype)
    dt_bias, A, D = torch.randn(H, generator=g) * 0.5, -torch.rand(H, generator=g) - 0.1, torch.randn(H, generator=g)
    init = torch.randn(len(lens), H, P, N, generator=g)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    e = torch.tensor(emit, dtype=torch.int64)
    _, _, want = ssd_scan_varlen_ref(x, dt, dt_bias, A, B, C, D, qsl, init, chunk_size, emit_at=e)
    y0, f0 = triton_ssd_scan_varlen(x, dt, dt_bias, A, B, C, D, qsl, init, chunk_size, **kw)
    y, f, got = triton_ssd_scan_varlen(x, dt, dt_bias, A, B, C, D, qsl, init, chunk_size, emit_at=e, **kw)
    assert torch.equal(y, y0) and torch.equal(f, f0), "emitting changed y / final"
    err = (got - want).abs().max().item() / (1 + want.abs().max().item())
    tol = 1e-5 if dtype == F32 else 2e-3
    assert err <= tol, f"emit err {err:.2e}"
    return {"emit": err}


def check_engine_prefix_hits():
    """End to end on the Triton Mamba ops: chunked prefills that save checkpoints, requests that
    restore them (the first Mamba layer restores every layer; the pooled scan reads and writes the
    slots; the chunk layout is shared by the layers) give transformers' greedy tokens."""
    import tempfile
    from pathlib import Path
    from hf_reference import hf_greedy
    from hybrid_engine import LLM, SamplingParams
    from hybrid_engine.models.synthetic import make_hf_model
    d = make_hf_model(Path(tempfile.mkdtemp(prefix="interp_prefix_")) / "m", pattern="M-M*-ME*", seed=1)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (30,), generator=g).tolist()
    fresh = torch.randint(3, 256, (9,), generator=g).tolist()     # no hit: starts from zeros in a used slot
    batch = [prompt, prompt[:16] + [7, 8, 9], prompt[:21] + [5], fresh]
    want = hf_greedy(d, batch, 3)
    llm = LLM(str(d), dtype="float32", device="cpu", max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
              async_scheduling=False, enable_prefix_caching=True, mamba_checkpoint_interval=2)
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    out = [o for part in (batch[:1], batch[1:3], batch[3:]) for o in llm.generate(part, sp, use_tqdm=False)]
    got = [list(o.outputs[0].token_ids) for o in out]
    cached = [o.num_cached_tokens for o in out]
    assert got == want, (got, want)
    assert cached[0] == cached[3] == 0 and min(cached[1:3]) >= 16, cached
    return {"cached": cached}


def _restore():
    from hybrid_engine.mamba_cache.ops.triton_restore import triton_restore_rows
    return triton_restore_rows


CASES = {
    "engine_prefix_hits": lambda: _on_triton(check_engine_prefix_hits),
    "emit_kernel": lambda: cc.check_emit(emit_states, "cpu", F32, [21, 7, 16, 1],
                                         [0, 3, 15, 16, 20, 21, 27, 28, 43, 44], 16),
    "emit_kernel_long_chunks": lambda: cc.check_emit(emit_states, "cpu", F32, [70, 5],
                                                     [0, 31, 32, 47, 48, 69, 74], 48, seed=1),
    "conv_windows": lambda: cc.check_conv_windows(
        triton_conv_windows_before, "cpu", F32, [5, 1, 9, 2],
        [(0, 0), (0, 1), (0, 2), (0, 4), (1, 0), (2, 0), (2, 1), (2, 8), (3, 1)]),
    "conv_windows_w2_channel_major": lambda: cc.check_conv_windows(
        triton_conv_windows_before, "cpu", F32, [3, 4], [(0, 0), (1, 3)], W=2, K=0, token_major=False, seed=1),
    "emit_kernel_one_seq": lambda: cc.check_emit(emit_states, "cpu", F32, [40], [0, 15, 16, 39], 16, seed=2),
    "restore_rows": lambda: cc.check_restore(_restore(), "cpu", F32),
    "restore_rows_padding": lambda: cc.check_restore(_restore(), "cpu", F32, slots=(4, 1, 5), rows=(2, -1, 4)),
    "restore_rows_f16": lambda: cc.check_restore(_restore(), "cpu", torch.float16, C=33, W=2, K=0, H=2, P=3, N=130,
                                                 slots=(2,), rows=(4,), seed=1),
    "emit_kernel_rows": lambda: cc.check_emit(emit_states, "cpu", F32, [21, 7, 16, 1], [0, 15, 16, 27, 43], 16,
                                              seed=3, rows=True),
    "conv_windows_rows": lambda: cc.check_conv_windows(
        triton_conv_windows_before, "cpu", F32, [5, 1, 9, 2], [(0, 0), (0, 4), (1, 0), (2, 1), (2, 8), (3, 1)],
        seed=2, rows=True),
    "ssd_emit": lambda: check_ssd_emit(F32, [21, 7, 16, 1], [0, 3, 15, 16, 20, 21, 27, 28, 43, 44]),
    "ssd_emit_lowp_f16": lambda: check_ssd_emit(torch.float16, [40, 9], [0, 15, 16, 31, 39, 40, 48],
                                                 chunk_size=16, seed=1, lowp=True),
    "conv_varlen": lambda: kc.check_conv_varlen(triton_causal_conv1d_varlen, "cpu", F32,
                                                [5, 1, 0, 2, 17], 24, W=4, K=3),
    # long sequences: most token blocks take the kernel's x-only path (no tap before a start);
    # x strided like the in_proj output's xBC columns. Sequences start at 0, 30 (an empty row, the
    # null slot), 30, 61, 96 and 127: the 16-token block at 32 holds positions 2.. of its
    # sequence (general path), the one at 64 starts at position W-1 = 3 and the one at 80 ends
    # with its sequence (x-only path), and the one at 112 ends one token into the next sequence
    # (general path)
    "conv_varlen_long_rows": lambda: kc.check_conv_varlen(triton_causal_conv1d_varlen, "cpu", F32,
                                                          [30, 0, 31, 35, 31, 20], 24, W=4, K=3, seed=2,
                                                          x_row_extra=40),
    # no tokens at all: the windows of rows without an initial state are still zeroed
    "conv_varlen_no_tokens": lambda: kc.check_conv_varlen(triton_causal_conv1d_varlen, "cpu", F32,
                                                          [0, 0, 0], 8, W=4, K=2, pad=0),
    "conv_varlen_w2": lambda: kc.check_conv_varlen(triton_causal_conv1d_varlen, "cpu", F32,
                                                   [1, 3], 8, W=2, K=0, bias=False, seed=1),
    "conv_update": lambda: kc.check_conv_update(triton_causal_conv1d_update, "cpu", F32,
                                                5, 4, 24, K=3),
    "conv_update_channel_major": lambda: kc.check_conv_update(
        triton_causal_conv1d_update, "cpu", F32, 5, 4, 24, K=3, token_major=False, seed=3),
    "conv_varlen_channel_major": lambda: kc.check_conv_varlen(
        triton_causal_conv1d_varlen, "cpu", F32, [5, 1, 0, 2, 17], 24, W=4, K=3,
        token_major=False, seed=3),
    "conv_update_k8": lambda: kc.check_conv_update(triton_causal_conv1d_update, "cpu", F32,
                                                   4, 9, 16, K=8, seed=1),
    # conv-update variants (triton_causal_conv1d_update options): the previous kernel, the cols
    # kernel without hints (the default has 2 rows per program and .cs stores)
    "conv_update_window": lambda: kc.check_conv_update(
        functools.partial(triton_causal_conv1d_update, variant="window"), "cpu", F32,
        5, 4, 24, K=3, seed=4),
    "conv_update_cols": lambda: kc.check_conv_update(
        functools.partial(triton_causal_conv1d_update, variant="cols", rows_per_program=1,
                          cache_hints="none"), "cpu", F32, 5, 4, 24, K=3, seed=4),
    "conv_update_cols_rows": lambda: kc.check_conv_update(
        functools.partial(triton_causal_conv1d_update, rows_per_program=4, block_c=16), "cpu",
        F32, 7, 2, 40, K=1, token_major=False, seed=5),
    "conv_update_cols_taps_w3": lambda: kc.check_conv_update(
        functools.partial(triton_causal_conv1d_update, rows_per_program=2, weight_load="taps"),
        "cpu", F32, 5, 3, 20, W=3, K=2, bias=False, seed=6),
    "conv_update_cols_flat_w2_f16": lambda: kc.check_conv_update(
        functools.partial(triton_causal_conv1d_update, weight_load="flat", block_c=8), "cpu",
        torch.float16, 4, 2, 20, W=2, K=5, seed=7),
    "conv_update_cols_order_hints": lambda: kc.check_conv_update(
        functools.partial(triton_causal_conv1d_update, rows_per_program=2, inputs_first=True,
                          channels_fast=True, cache_hints="evict+cg+cs", pdl=2, block_c=16),
        "cpu", F32, 5, 4, 24, K=3, seed=8),
    "conv_update_tap_major_weight": lambda: [kc.check_conv_update(
        functools.partial(triton_causal_conv1d_update, **o), "cpu", F32, 5, 4, 24, K=3,
        tap_major_weight=True, seed=9) for o in ({}, dict(rows_per_program=2))],
    "ssu": lambda: kc.check_ssu(triton_selective_state_update, "cpu", F32, 5, 3, 4,
                                dt_limit=(0.01, 0.4)),
    "ssu_out_f16": lambda: kc.check_ssu(triton_selective_state_update, "cpu", F32, 4, 2, 1,
                                        out_dtype=torch.float16, seed=2),
    "ssu_k0": lambda: kc.check_ssu(triton_selective_state_update, "cpu", F32, 3, 1, 0, seed=1),
    # next-token load-ahead against the plain loop, bit for bit (plain and gated, s = 3 and 4)
    # (then 2 head_dim blocks per head with the dt clamp)
    "ssu_load_ahead": lambda: [kc.check_ssu_load_ahead_bitwise("cpu", F32, 5, 3, 4, False),
                             kc.check_ssu_load_ahead_bitwise("cpu", F32, 3, 4, 3, True, seed=1),
                             kc.check_ssu_load_ahead_bitwise("cpu", F32, 3, 2, 1, True, P=32, block_p=16,
                                                             dt_limit=(0.01, 0.4), seed=2)],
    # the deferred state update (CONTRACT item 4b) against the checkpointed kernel, bit for bit, over
    # 5 verify steps: plain with the dt clamp, then gated, then 3 head_dim blocks per head in float16,
    # then the public gated op (a verify: the unfused update and the standalone norm)
    "ssu_deferred": lambda: [sdc.check_ssu_deferred(triton_selective_state_update, "cpu", F32, 5, 3,
                                                   dt_limit=(0.01, 0.4)),
                             sdc.check_ssu_deferred(triton_selective_state_update_gated, "cpu", F32, 4, 2,
                                                   gated=True, seed=1),
                             sdc.check_ssu_deferred(triton_selective_state_update, "cpu", torch.float16, 3, 4,
                                                   P=40, Nst=128, steps=3, seed=2),
                             _on_triton(lambda: sdc.check_ssu_deferred(   # the public op: two kernels
                                 selective_state_update_gated, "cpu", F32, 3, 2, gated=True, out_tol=1e-5, seed=3))],
    # state update + gated norm in one kernel: 2 heads per norm group; then 1 head per group with
    # z as [N, s, I]; then 2 head_dim blocks per head (4 programs per group), 3 norm groups over
    # 2 SSM groups, 2 tokens per norm step (s = 3: a short second step); then a 16-bit model
    "ssu_norm": lambda: kc.check_ssu_norm(triton_selective_state_update_gated, "cpu", F32, 5, 3, 4,
                                          dt_limit=(0.01, 0.4)),
    "ssu_norm_k0": lambda: kc.check_ssu_norm(triton_selective_state_update_gated, "cpu", F32, 3, 1,
                                             0, G=1, norm_groups=4, z_3d=True, seed=1),
    "ssu_norm_pblocks": lambda: kc.check_ssu_norm(
        functools.partial(triton_selective_state_update_gated, block_p=8, block_s=2), "cpu", F32,
        4, 3, 2, H=6, G=2, P=12, Nst=8, norm_groups=3, seed=2),
    "ssu_norm_f16": lambda: kc.check_ssu_norm(triton_selective_state_update_gated, "cpu",
                                              torch.float16, 4, 2, 1, seed=3),
    # the public op on the Triton backend: one kernel, then half a head per norm group (the
    # two-kernel path)
    "ssu_norm_dispatch": lambda: [_on_triton(lambda: kc.check_ssu_norm(
        selective_state_update_gated, "cpu", F32, 3, 2, 1, norm_groups=ng, seed=4))
        for ng in (1, 8)],
    "ssd": lambda: kc.check_ssd(triton_ssd_scan_varlen, "cpu", F32, [16, 1, 0, 35, 7]),
    # float32 defaults to C.B precomputed per (chunk, group); the per-head kernel's own C.B too
    "ssd_f32_no_cb_pre": lambda: kc.check_ssd(
        lambda *a, **k: triton_ssd_scan_varlen(*a, cb_pre=False, **k), "cpu", F32, [16, 1, 0, 35, 7]),
    "ssd_pooled": lambda: spc.check_ssd_pooled(triton_ssd_scan_varlen_pooled, "cpu", F32, [16, 1, 35, 7, 9, 4],
                                              fresh=(1, 2, 5), null_rows=(4, 5)),
    "ssd_pooled_emit": lambda: spc.check_ssd_pooled(triton_ssd_scan_varlen_pooled, "cpu", F32, [21, 9],
                                                   fresh=(0,), emit=[3, 15, 16, 20, 29], seed=1),
    "ssd_pooled_step_layout": lambda: spc.check_ssd_pooled(triton_ssd_scan_varlen_pooled, "cpu", F32, [40, 3, 17],
                                                          fresh=(2,), chunk_size=16, step_layout=True, seed=2),
    "ssd_odd": lambda: kc.check_ssd(triton_ssd_scan_varlen, "cpu", F32, [20, 3], H=6, G=3, P=12,
                                    N=20, chunk_size=8, dt_limit=(0.0, 0.5), seed=1),
    "ssd_fp16_variants": lambda: kc.check_ssd(      # the per-head kernel with 16-bit dots
        lambda *a, **k: triton_ssd_scan_varlen(*a, lowp=True, cb_pre=True, block_m=16,
                                               block_k=16, heads_per_program=1, **k),
        "cpu", torch.float16, [16, 1, 0, 35, 7], chunk_size=32, seed=2),
    "ssd_out_f16": lambda: kc.check_ssd(triton_ssd_scan_varlen, "cpu", F32, [16, 1, 0, 35, 7],
                                        out_dtype=torch.float16, seed=4),
    "ssd_pblocks": lambda: kc.check_ssd(
        lambda *a, **k: triton_ssd_scan_varlen(*a, cb_pre=True, block_p=16, block_m=16,
                                               block_k=16, **k),
        "cpu", F32, [16, 1, 0, 35, 7], P=40, chunk_size=32, seed=5),
    # the default chunk output of fp16 models (the multi-head kernel: 4 heads per program, C.B
    # in the model dtype): 3 heads per group (a short head block), chunk 128 (two row blocks; the
    # first skips the second half of the chunk), then chunk 16 (one step over the chunk)
    "ssd_default_f16": lambda: [
        kc.check_ssd(triton_ssd_scan_varlen, "cpu", torch.float16, [150, 1, 0, 70], H=6, G=2,
                     chunk_size=128, seed=6, out_dtype=torch.float16),
        kc.check_ssd(triton_ssd_scan_varlen, "cpu", torch.float16, [16, 1, 0, 35, 7], H=8, G=2,
                     chunk_size=16, seed=7)],
    # chunk-output options (triton_ssd_scan_varlen docstring): C.B precomputed in the model dtype
    # (per-head kernel), several heads per program with float32 dots, and with C.B precomputed
    "ssd_cb_model_f16": lambda: kc.check_ssd(
        lambda *a, **k: triton_ssd_scan_varlen(*a, heads_per_program=1, cb_pre=True,
                                               cb_dtype="model", block_m=16,
                                               block_k=16, block_p=16, **k),
        "cpu", torch.float16, [16, 1, 0, 35, 7], P=32, chunk_size=32, seed=6),
    "ssd_heads_loop": lambda: kc.check_ssd(
        lambda *a, **k: triton_ssd_scan_varlen(*a, heads_per_program=2, block_m=16, **k),
        "cpu", F32, [20, 0, 45, 3], H=6, G=2, P=12, N=20, chunk_size=32, seed=8),
    "ssd_heads_cb_pre_f16": lambda: kc.check_ssd(
        lambda *a, **k: triton_ssd_scan_varlen(*a, heads_per_program=4, cb_pre=True,
                                               cb_dtype="model", block_m=16, block_p=16, **k),
        "cpu", torch.float16, [16, 1, 0, 35, 7], H=12, G=2, P=24, chunk_size=32, seed=9),
    # chunk-state (step 2) options on the unfused kernels: K step, P block, launch knobs; 3 / 6
    # heads per group, P not a power of two, sequences of 0 / 1 tokens and of whole chunks,
    # several K steps
    "ssd_state_opts": lambda: [kc.check_ssd(       # chunk-state options: K step, P block, launch
        lambda *a, **k: triton_ssd_scan_varlen(*a, state_block_k=bk, state_block_p=bp, fused_pass=False, **k),
        "cpu", F32, [20, 0, 1, 45, 32, 3], H=6, G=2, P=P, N=20, chunk_size=32, seed=10 + bk)
        for bk, bp, P in ((16, None, 12), (32, 16, 40))],
    "ssd_state_opts_f16": lambda: kc.check_ssd(
        lambda *a, **k: triton_ssd_scan_varlen(*a, state_block_k=16, state_num_warps=8,
                                               state_num_stages=2, fused_pass=False, **k),
        "cpu", torch.float16, [16, 1, 0, 35, 7], H=12, G=2, P=24, chunk_size=32, seed=14,
        out_dtype=torch.float16),
    # steps 2 and 3 fused (triton_ssd_fused_pass, the default) on many chunks, with its options
    # (P not a power of two: masked columns), and the unfused kernels forced
    "ssd_fused_long": lambda: kc.check_ssd(
        lambda *a, **k: triton_ssd_scan_varlen(*a, fused_pass=True, fused_block_k=16, fused_block_p=16, **k),
        "cpu", F32, [150, 1, 0, 70], H=6, G=2, P=40, N=20, chunk_size=16, seed=15),
    "ssd_unfused": lambda: kc.check_ssd(
        lambda *a, **k: triton_ssd_scan_varlen(*a, fused_pass=False, **k), "cpu", F32, [16, 1, 0, 35, 7], seed=16),
    "ssd_pooled_fused_emit": lambda: [spc.check_ssd_pooled(
        lambda *a, **k: triton_ssd_scan_varlen_pooled(*a, fused_pass=fused, **k), "cpu", dt, [21, 9, 40],
        fresh=(0,), null_rows=(2,), emit=[3, 15, 16, 20, 29], seed=17) for fused, dt in ((True, torch.float16),
                                                                                   (False, torch.float16))],
    # unfused float32: the entry states stay in place over S, which the emits read; emits in the
    # null row 3 (tokens 30-69) too
    "ssd_pooled_unfused_emit": lambda: spc.check_ssd_pooled(
        lambda *a, **k: triton_ssd_scan_varlen_pooled(*a, fused_pass=False, **k), "cpu", F32, [21, 9, 0, 40],
        fresh=(1,), null_rows=(3,), emit=[3, 15, 16, 20, 29, 45, 69], seed=18),
    # the emits stored by the fused pass itself (fused_emits): into checkpoint rows (pooled; a
    # fresh row, emits in the null row 3 (tokens 30-69), two emits in one chunk, a token emitted
    # twice into two rows) and into a new [M, H, P, N] (f16 with lowp: no float32 copy of the
    # entry states exists then)
    "ssd_fused_emits": lambda: [
        spc.check_ssd_pooled(lambda *a, **k: triton_ssd_scan_varlen_pooled(*a, fused_pass=True, fused_emits=True, **k),
                             "cpu", F32, [21, 9, 0, 40], fresh=(1,), null_rows=(3,),
                             emit=[3, 15, 16, 20, 29, 29, 45, 69], seed=19),
        check_ssd_emit(torch.float16, [40, 9], [0, 15, 16, 31, 39, 40, 48], chunk_size=16, seed=3, lowp=True,
                       fused_pass=True, fused_emits=True),
        check_ssd_emit(F32, [21, 7, 16, 1], [0, 3, 15, 16, 20, 21, 27, 28, 43, 44], seed=4, fused_pass=True,
                       fused_emits=True)],
    # f16 emits three ways at 16 head_dim columns: the fused pass storing them, the fused pass's
    # float32 entry states read by the emit kernel, and the two unfused kernels
    # the fused pass's emit walk at its edges (binary search per sequence, then one walk): empty
    # sequences first, between and last; a token emitted three times; an emit on every token;
    # emits on both sides of every chunk edge; an unsorted emit_at (sorted on the device first,
    # each emit keeping its output row) and one the caller says is sorted
    "ssd_fused_emit_edges": lambda: [check_ssd_emit(F32, lens, emit, seed=seed, fused_pass=True, fused_emits=True, **kw)
                                     for lens, emit, seed, kw in (
        ([0, 21, 0, 7, 16, 0, 1, 0], [0, 15, 15, 16, 20, 21, 27, 28, 31, 32, 43, 44, 44, 44], 6, {}),
        ([40, 9], list(range(49)), 7, dict(emits_sorted=True)),
        ([17, 8, 24], [7, 8, 15, 16, 24, 25, 32, 33, 40, 48], 8, dict(chunk_size=8)),
        ([21, 7, 16], [27, 3, 20, 0, 43, 3], 9, {}))],
    # 64 head_dim columns in 64-token chunks, f16: few programs, so the narrow blocks (16 columns,
    # emits by the emit kernel unless asked in), and 32-column blocks, with the emits either way;
    # check_ssd_emit also asserts y and the final states are those of the call without emits
    "ssd_emit_blocks_f16": lambda: [check_ssd_emit(torch.float16, [130, 70], [0, 63, 64, 129, 130, 199], chunk_size=64,
                                                   H=2, G=1, P=64, seed=10, lowp=True, **kw)
                                    for kw in (dict(), dict(fused_emits=True),
                                               dict(fused_block_p=32, fused_block_k=32, fused_num_warps=4,
                                                    fused_emits=True),
                                               dict(fused_block_p=32, fused_block_k=32, fused_num_warps=4,
                                                    fused_emits=False))],
    "ssd_emit_fused_f16": lambda: [check_ssd_emit(torch.float16, [40, 9], [0, 15, 16, 31, 39, 40, 48], chunk_size=16,
                                                  seed=2, lowp=True, **kw)
                                   for kw in (dict(fused_emits=True), dict(fused_emits=False), dict(fused_pass=False))],
    "ssd_sequential": lambda: kc.check_ssd(triton_ssd_scan_sequential, "cpu", F32, [9, 0, 4]),
    "norm": lambda: kc.check_norm(triton_gated_rmsnorm, "cpu", F32, 5, 48, 12),
    "norm_then_gate": lambda: kc.check_norm(triton_gated_rmsnorm, "cpu", F32, 5, 48, 12, seed=3,
                                            mode="norm_then_gate"),
    "norm_gate_only": lambda: kc.check_norm(triton_gated_rmsnorm, "cpu", F32, 5, 48, 12, seed=4, mode="gate_only"),
    "norm_opts": lambda: [kc.check_norm(lambda *a: triton_gated_rmsnorm(*a, block_t=bt, num_warps=nw,
                                                                        streaming=st),
                                        "cpu", F32, 5, 48, 12, seed=bt) for bt, nw, st in ((1, 1, False),
                                                                                          (2, 2, True))],
    "linear_fma": lambda: [lc.check_linear(lambda x, w, b: skinny_linear_fma(
        x, w, b, block_n=8, block_k=64), "cpu", F32, M, N, K, bias=M != 2, seed=M)
        for M, N, K in ((1, 37, 100), (2, 16, 64), (4, 130, 300), (6, 20, 90))],
    "linear_fma_rows_invariant": lambda: lc.check_linear_rows_invariant(
        lambda x, w, b: skinny_linear_fma(x, w, b, block_n=8, block_k=64), "cpu", 8, 21, 150),
    "linear_dot": lambda: [lc.check_linear(lambda x, w, b: skinny_linear_dot(
        x, w, b, block_n=32, block_k=64), "cpu", F32, M, N, K, bias=M != 3, seed=M)
        for M, N, K in ((1, 37, 100), (3, 64, 256), (16, 65, 129))],
    # relu² applied as x is loaded (the relu² MLP's down_proj); bfloat16 rounds on the bits there
    "linear_fma_relu2": lambda: [lc.check_linear_relu2(lambda x, w, b, **k: skinny_linear_fma(
        x, w, b, block_n=8, block_k=64, **k), "cpu", dt, M, N, K, bias=M != 2, seed=M)
        for dt, M, N, K in ((F32, 1, 37, 100), (torch.float16, 2, 16, 64), (torch.bfloat16, 1, 20, 90),
                            (torch.bfloat16, 5, 9, 70))],
    # the dispatcher: relu² on load in the FMA kernel, the relu² kernel before the dot kernel
    "linear_dispatch_relu2": lambda: [lc.check_linear_relu2(skinny_linear, "cpu", torch.float16, M, 40, 96,
                                                            bias=M % 2 == 0, seed=M) for M in range(1, 9)],
}


# model-side kernels (block norm, fused residual add + norm, relu²): float32 and float16
import model_kernel_cases as mkc  # noqa: E402
from hybrid_engine.models.activation import relu2_triton  # noqa: E402
from hybrid_engine.models.rmsnorm import fused_add_rmsnorm_triton, rmsnorm_triton  # noqa: E402

CASES.update({
    "rmsnorm": lambda: mkc.check_rmsnorm(rmsnorm_triton, "cpu", F32, 5, 48),
    "add_rmsnorm": lambda: mkc.check_add_rmsnorm(fused_add_rmsnorm_triton, rmsnorm_triton,
                                                 "cpu", F32, 5, 100, seed=1),
    "add_rmsnorm_f16": lambda: mkc.check_add_rmsnorm(fused_add_rmsnorm_triton, rmsnorm_triton,
                                                     "cpu", torch.float16, 3, 64, seed=2),
    "relu2": lambda: mkc.check_relu2(relu2_triton, "cpu", F32, 3, 700),
    "relu2_f16": lambda: mkc.check_relu2(relu2_triton, "cpu", torch.float16, 2, 1500, seed=1),
})

# paged attention: decode, verify and prefill rows, key-range splits, FP8 caches
from attention_interpret_cases import ATTENTION_CASES  # noqa: E402

CASES.update(ATTENTION_CASES)


def main(names):
    return case_main(CASES, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
