"""SSD scan, multi-token state update and gated RMSNorm vs the float64 oracles."""
import math

import pytest
import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops import (
    gated_rmsnorm,
    selective_state_update,
    ssd_scan_naive,
    ssd_scan_varlen,
    ssd_scan_varlen_pooled,
)
from oracles import F64, close, dt64, qsl_of, silu64, ssm_params, ssm_seq64, tol_of


# ----------------------------------------------------------------------------- SSD scan

def run_ssd_case(lens, H, G, P, N, chunk, gen, dt_limit=(0.0, math.inf), small_dt=False,
                 idx_dtype=torch.int32, max_seqlen=None):
    T = sum(lens)
    x = torch.randn(T, H, P, generator=gen)
    dt_raw = torch.randn(T, H, generator=gen)
    dt_bias, A, D = ssm_params(H, G, N, P, gen, small_dt)
    B = torch.randn(T, G, N, generator=gen)
    C = torch.randn(T, G, N, generator=gen)
    init = torch.randn(len(lens), H, P, N, generator=gen)
    qsl = qsl_of(lens, idx_dtype)
    y, fin = ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, qsl, init, chunk, dt_limit,
                             max_seqlen=max_seqlen)
    assert y.dtype == torch.float32 and fin.dtype == torch.float32
    assert y.shape == (T, H, P) and fin.shape == init.shape
    dt = dt64(dt_raw, dt_bias, dt_limit)
    st = qsl.tolist()
    for b in range(len(lens)):
        yr, hs = ssm_seq64(init[b], x[st[b]:st[b + 1]], dt[st[b]:st[b + 1]], A,
                           B[st[b]:st[b + 1]], C[st[b]:st[b + 1]], D)
        close(y[st[b]:st[b + 1]], yr, 1e-5)
        close(fin[b], hs[-1] if lens[b] else init[b], 1e-5)
    # the package's own oracle agrees too
    yn, fn = ssd_scan_naive(x, dt_raw, dt_bias, A, B, C, D, qsl, init, chunk, dt_limit)
    close(y, yn, 1e-5)
    close(fin, fn, 1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk", [4, 8])
def test_ssd_chunk_boundaries(seed, chunk):
    gen = torch.Generator().manual_seed(seed)
    lens = [chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 1, 0, 3]
    lens = lens[seed:] + lens[:seed]                         # vary the order
    run_ssd_case(lens, H=4, G=2, P=3, N=5, chunk=chunk, gen=gen,
                 idx_dtype=torch.int64 if seed % 2 else torch.int32)


@pytest.mark.parametrize("G", [1, 4])
def test_ssd_groups_and_single_sequence(G):
    gen = torch.Generator().manual_seed(11)
    run_ssd_case([37], H=4, G=G, P=4, N=8, chunk=8, gen=gen)
    run_ssd_case([5], H=4, G=G, P=4, N=8, chunk=16, gen=gen)          # shorter than a chunk


def test_ssd_dt_limit_and_hint():
    gen = torch.Generator().manual_seed(12)
    run_ssd_case([9, 20, 2], H=3, G=1, P=2, N=4, chunk=8, gen=gen, dt_limit=(1e-3, 0.5),
                 small_dt=True)
    run_ssd_case([9, 20, 2], H=3, G=1, P=2, N=4, chunk=8, gen=gen, max_seqlen=20)
    run_ssd_case([3, 5], H=3, G=1, P=2, N=4, chunk=64, gen=gen, max_seqlen=5)


@pytest.mark.parametrize("hint", [None, 20])
def test_ssd_device_grid_bounds(monkeypatch, hint):
    """The device path sizes its chunk grid from T, B (and the hint), not from query_start_loc;
    force that path on CPU."""
    import functools
    import hybrid_engine.mamba_cache.ops.ssd as ssd_mod
    monkeypatch.setattr(ssd_mod, "_grid_size", functools.partial(ssd_mod._grid_size, exact=False))
    gen = torch.Generator().manual_seed(15)
    run_ssd_case([7, 0, 20, 1, 8, 9], H=4, G=2, P=3, N=4, chunk=8, gen=gen, max_seqlen=hint)


def test_ssd_long_chunk_exact():
    """A long chunk with strong decay: segment sums must not cancel."""
    gen = torch.Generator().manual_seed(13)
    run_ssd_case([130, 64], H=2, G=1, P=2, N=3, chunk=64, gen=gen)


def test_ssd_all_empty_and_padding_tokens():
    gen = torch.Generator().manual_seed(14)
    H, P, N = 2, 3, 4
    init = torch.randn(2, H, P, N, generator=gen)
    dt_bias, A, D = ssm_params(H, 1, N, P, gen)
    e = torch.zeros(0, H, P)
    y, fin = ssd_scan_varlen(e, torch.zeros(0, H), dt_bias, A, torch.zeros(0, 1, N),
                             torch.zeros(0, 1, N), D, torch.tensor([0, 0, 0]), init, 8)
    assert y.shape == (0, H, P)
    torch.testing.assert_close(fin, init)
    # trailing padding tokens (NaN) past query_start_loc[B] do not disturb real rows
    T = 12
    x = torch.randn(T, H, P, generator=gen)
    dt_raw = torch.randn(T, H, generator=gen)
    Bm, Cm = torch.randn(T, 1, N, generator=gen), torch.randn(T, 1, N, generator=gen)
    qsl = torch.tensor([0, 4, 9])
    y_ref, f_ref = ssd_scan_varlen(x[:9], dt_raw[:9], dt_bias, A, Bm[:9], Cm[:9], D, qsl, init, 4)
    x[9:], dt_raw[9:], Bm[9:] = math.nan, math.nan, math.nan
    y2, f2 = ssd_scan_varlen(x, dt_raw, dt_bias, A, Bm, Cm, D, qsl, init, 4)
    torch.testing.assert_close(y2[:9], y_ref)
    torch.testing.assert_close(f2, f_ref)


# ----------------------------------------------------------------------------- state update

@pytest.mark.parametrize("K", [0, 1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_state_update_vs_naive(K, seed):
    gen = torch.Generator().manual_seed(200 + seed)
    H, G, P, N, S, Nr = 4, 2, 3, 5, 8, 5
    dtype = torch.bfloat16 if seed else torch.float32       # model-dtype inputs, f32 state
    dt_bias, A, D = ssm_params(H, G, N, P, gen)
    for s in sorted({1, K + 1, max(1, K // 2 + 1)}):
        x = torch.randn(Nr, s, H, P, generator=gen).to(dtype)
        dt_raw = torch.randn(Nr, s, H, generator=gen).to(dtype)
        B = torch.randn(Nr, s, G, N, generator=gen).to(dtype)
        C = torch.randn(Nr, s, G, N, generator=gen).to(dtype)
        pool = torch.full((S, 1 + K, H, P, N), math.nan)
        slots = torch.randperm(S - 1, generator=gen)[:Nr] + 1
        slots[3] = NULL_SLOT
        pool[slots] = torch.randn(Nr, 1 + K, H, P, N, generator=gen)
        pool[NULL_SLOT] = -7.0                               # finite: a NaN write would hide
        acc = torch.randint(1, K + 2, (Nr,), generator=gen)
        before = pool.clone()
        y = selective_state_update(pool, x, dt_raw, dt_bias, A, B, C, D,
                                   slots.to(torch.int32), acc, dt_limit=(0.0, math.inf))
        assert y.dtype == torch.float32 and y.shape == (Nr, s, H, P)
        for r in range(Nr):
            if slots[r] == NULL_SLOT:
                continue
            h0 = before[slots[r], int(acc[r]) - 1]
            yr, hs = ssm_seq64(h0, x[r], dt64(dt_raw[r], dt_bias), A, B[r], C[r], D)
            close(y[r], yr, 1e-5)
            close(pool[slots[r], :s], hs, 1e-5)
            torch.testing.assert_close(pool[slots[r], s:], before[slots[r], s:],
                                       equal_nan=True, rtol=0, atol=0)
        used = set(slots.tolist())
        for sl in range(S):
            if sl not in used or sl == NULL_SLOT:
                torch.testing.assert_close(pool[sl], before[sl], equal_nan=True, rtol=0, atol=0)


def test_state_update_dt_limit():
    gen = torch.Generator().manual_seed(300)
    H, G, P, N = 2, 1, 2, 3
    dt_bias, A, D = ssm_params(H, G, N, P, gen, small_dt=True)
    x = torch.randn(2, 2, H, P, generator=gen)
    dt_raw = torch.randn(2, 2, H, generator=gen)
    B, C = torch.randn(2, 2, G, N, generator=gen), torch.randn(2, 2, G, N, generator=gen)
    pool = torch.randn(3, 2, H, P, N, generator=gen)
    h0 = pool[1:3, 0].clone()
    lim = (1e-3, 0.3)
    y = selective_state_update(pool, x, dt_raw, dt_bias, A, B, C, D, torch.tensor([1, 2]),
                               torch.tensor([1, 1]), lim)
    for r in range(2):
        yr, hs = ssm_seq64(h0[r], x[r], dt64(dt_raw[r], dt_bias, lim), A, B[r], C[r], D)
        close(y[r], yr, 1e-5)
        close(pool[1 + r], hs, 1e-5)


# ----------------------------------------------------------------------------- gated rmsnorm

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [4, 16])
def test_gated_rmsnorm(dtype, group_size):
    gen = torch.Generator().manual_seed(group_size)
    T, I, eps = 7, 16, 1e-5
    y = (torch.randn(T, I, generator=gen) * 3).to(dtype)
    z = torch.randn(T, I, generator=gen).to(dtype)
    w = torch.randn(I, generator=gen).to(dtype)
    out = gated_rmsnorm(y, z, w, group_size, eps)
    assert out.dtype == dtype and out.shape == (T, I)
    ref = torch.empty(T, I, dtype=F64)
    for t in range(T):
        g = y[t].to(F64) * silu64(z[t].to(F64))
        for s in range(0, I, group_size):
            seg = g[s: s + group_size]
            ref[t, s: s + group_size] = seg / torch.sqrt((seg * seg).mean() + eps)
    close(out, w.to(F64) * ref, tol_of(dtype))


def test_ssd_pooled_reads_and_writes_the_slots():
    """The pooled form (what the mixer's prefill calls): each row starts from its slot's state, or
    from zeros where it starts fresh whatever the slot holds (NaN here), and leaves its final state
    there; the sequential float64 oracle decides, and no other slot changes."""
    gen = torch.Generator().manual_seed(5)
    lens, H, G, P, N, chunk = [9, 1, 20, 4], 4, 2, 3, 5, 8
    T, S = sum(lens), 7
    x = torch.randn(T, H, P, generator=gen)
    dt_raw = torch.randn(T, H, generator=gen)
    dt_bias, A, D = ssm_params(H, G, N, P, gen, False)
    B = torch.randn(T, G, N, generator=gen)
    C = torch.randn(T, G, N, generator=gen)
    pool = torch.randn(S, 2, H, P, N, generator=gen)           # [S, 1+K, H, P, N], K = 1
    slots = torch.tensor([5, 2, 6, 1])
    has_init = torch.tensor([True, False, True, False])
    pool[2] = math.nan                                         # a fresh row's stale slot
    before = pool.clone()
    qsl = qsl_of(lens, torch.int64)
    y = ssd_scan_varlen_pooled(x, dt_raw, dt_bias, A, B, C, D, qsl, pool[:, 0], slots, has_init, chunk)
    dt = dt64(dt_raw, dt_bias, (0.0, math.inf))
    st = qsl.tolist()
    for b, slot in enumerate(slots.tolist()):
        h0 = before[slot, 0] if has_init[b] else torch.zeros(H, P, N)
        yr, hs = ssm_seq64(h0, x[st[b]:st[b + 1]], dt[st[b]:st[b + 1]], A, B[st[b]:st[b + 1]],
                           C[st[b]:st[b + 1]], D)
        close(y[st[b]:st[b + 1]], yr, 1e-5)
        close(pool[slot, 0], hs[-1], 1e-5)
    untouched = torch.ones(S, 2, dtype=torch.bool)
    untouched[slots, 0] = False
    assert torch.equal(pool[untouched].nan_to_num(0.0), before[untouched].nan_to_num(0.0))
    assert torch.equal(pool[untouched].isnan(), before[untouched].isnan())


def test_step_chunk_layout_per_chunk_size_and_fresh_after_replace():
    """MambaMetadata.ssd_chunk_layout: the prefill rows' int32 query_start_loc and cumulative chunk
    counts sum_b ceil(L_b / chunk) (written out here), one entry per chunk size (a draft model may
    scan with another), reused within the step; a replaced MambaMetadata starts empty."""
    import dataclasses
    from hybrid_engine.step.forward_batch import MambaMetadata
    z = torch.zeros(0, dtype=torch.int64)
    lens = [5, 0, 9, 16]
    qsl = qsl_of(lens, torch.int64)
    md = MambaMetadata(0, 1, z, z, qsl, tuple(qsl.tolist()), torch.arange(1, 5), torch.ones(4, dtype=torch.bool))
    for chunk in (4, 8, 4):
        q32, cum = md.ssd_chunk_layout(chunk)
        assert q32.dtype == cum.dtype == torch.int32 and q32.tolist() == qsl.tolist()
        assert cum.tolist() == [sum(-(-n // chunk) for n in lens[:b + 1]) for b in range(len(lens))]
    assert md.ssd_chunk_layout(4) is md.ssd_chunk_layout(4)
    other = dataclasses.replace(md, prefill_query_start_loc=qsl_of([3, 3], torch.int64))
    assert other.ssd_chunk_layout(4)[1].tolist() == [1, 2]


def test_ssd_kernel_options_of_the_kernels_that_do_not_run_are_refused():
    """The chunk-state options configure the unfused steps 2 and 3, the fused_* options the fused
    pass: passing one to the path that does not run is a ValueError naming it, not
    a silent no-op (a benchmark once timed the fused kernel under chunk-state labels). Raised on
    the host before any launch, so plain CPU tensors do."""
    from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen
    T, H, P, G, N = 8, 2, 4, 1, 4
    args = (torch.zeros(T, H, P), torch.zeros(T, H), torch.zeros(H), -torch.ones(H), torch.zeros(T, G, N),
            torch.zeros(T, G, N), torch.zeros(H), torch.tensor([0, T]), torch.zeros(1, H, P, N), 4)
    with pytest.raises(ValueError, match=r"state_block_k.*pass fused_pass=False"):      # the default fuses
        triton_ssd_scan_varlen(*args, state_block_k=16)
    with pytest.raises(ValueError, match=r"state_num_warps.*pass fused_pass=False"):
        triton_ssd_scan_varlen(*args, fused_pass=True, state_num_warps=8)
    with pytest.raises(ValueError, match=r"fused_block_p.*fused_pass=False turns off"):
        triton_ssd_scan_varlen(*args, fused_pass=False, fused_block_p=16)
    with pytest.raises(ValueError, match=r"fused_emits.*fused_pass=False turns off"):
        triton_ssd_scan_varlen(*args, fused_pass=False, fused_emits=True)
    with pytest.raises(ValueError, match=r"fused_emits.*fused_pass=False turns off"):   # even with no rows
        triton_ssd_scan_varlen(*args[:7], torch.tensor([0]), torch.zeros(0, H, P, N), 4, fused_pass=False,
                               fused_emits=True)

