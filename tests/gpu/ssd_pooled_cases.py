"""Random cases for the pooled SSD scan (``ssd_scan_varlen_pooled``: the mixer's form, reading and
writing the Mamba pool by slot and storing prefix-cache emits into checkpoint rows) against the
torch scan (imported by test_kernels.py and the interpreter subprocess of test_kernels_interpret.py;
not a test module itself). Conventions as kernel_cases.py."""
from __future__ import annotations

import math

import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops import ssd_scan_varlen_pooled_ref, ssd_scan_varlen_ref
from kernel_cases import TOL, _gen, _qsl, assert_close, assert_pool, poison_allocator, ssm_params


def check_ssd_pooled(impl, device, dtype, lens, fresh, H=4, G=2, P=16, N=16, chunk_size=16, K=2, seed=0,
                     emit=None, tol=None, step_layout=False, null_rows=()):
    """The pooled scan (``impl`` has ``ssd_scan_varlen_pooled_ref``'s signature) on a pool
    [S, 1+K, H, P, N] poisoned with NaN in its unused slots and in the slots of the rows that start
    fresh (``fresh``: row indices; they must read zeros, not the slot); rows get shuffled distinct
    slots. y (and the emitted states) match the reference; the rows' slots hold the reference's
    final states; every other pool value (other slots, checkpoints 1..K) is untouched.
    ``step_layout``: pass the chunk layout the mixer passes (``MambaMetadata.ssd_chunk_layout``).
    ``null_rows``: rows on NULL_SLOT (padding): their y is unspecified and slot 0 (NaN) must stay
    untouched."""
    g = _gen(seed)
    Bn, T = len(lens), sum(lens)
    x = torch.randn(T, H, P, generator=g).to(dtype)
    dt = (torch.randn(T, H, generator=g) * 0.5).to(dtype)
    B = torch.randn(T, G, N, generator=g).to(dtype)
    C = torch.randn(T, G, N, generator=g).to(dtype)
    dt_bias, A, D = ssm_params(H, g)
    S = Bn + 3
    slots = (torch.randperm(S - 1, generator=g)[:Bn] + 1).long()          # distinct, never NULL_SLOT
    slots[list(null_rows)] = NULL_SLOT
    live = slots != NULL_SLOT
    has_init = torch.tensor([b not in fresh for b in range(Bn)])
    pool = torch.full((S, 1 + K, H, P, N), math.nan)
    pool[slots[has_init & live]] = torch.randn(int((has_init & live).sum()), 1 + K, H, P, N, generator=g)
    pool[slots[~has_init & live], 1:] = torch.randn(int((~has_init & live).sum()), K, H, P, N, generator=g)
    qsl = _qsl(lens, torch.int64 if seed % 2 else torch.int32)
    d = lambda t: t.to(device)                                   # noqa: E731
    tok_live = torch.repeat_interleave(live, torch.tensor(lens))                 # [T] tokens of live rows
    x, dt, B, C, dt_bias, A, D, qsl, slots, has_init, pool, live, tok_live = map(
        d, (x, dt, B, C, dt_bias, A, D, qsl, slots, has_init, pool, live, tok_live))
    e = None if emit is None else d(torch.tensor(emit, dtype=torch.int64))
    init = torch.where((has_init & live).view(-1, 1, 1, 1), pool[slots, 0], 0.0)
    ref = ssd_scan_varlen_ref(x, dt, dt_bias, A, B, C, D, qsl, init, chunk_size, emit_at=e)
    want_pool = pool.clone()
    for b in range(Bn):
        if b not in null_rows:
            want_pool[slots[b], 0] = ref[1][b]
    pool_ref = pool.clone()
    # emits go to shuffled rows of a NaN checkpoint buffer with spare rows (which must stay NaN)
    R = 0 if e is None else e.numel() + 2
    rows = None if e is None else d((torch.randperm(R, generator=g)[:e.numel()]).long())
    emit_ref = torch.full((R, H, P, N), math.nan, device=device)
    emit_out = emit_ref.clone()
    ekw = {} if e is None else dict(emit_at=e, emit_rows=rows)
    ref_pooled = ssd_scan_varlen_pooled_ref(x, dt, dt_bias, A, B, C, D, qsl, pool_ref[:, 0], slots, has_init,
                                            chunk_size, emit_out=emit_ref, **ekw)
    kw = {}
    if step_layout:
        from hybrid_engine.step.forward_batch import MambaMetadata
        none = torch.zeros(0, dtype=torch.int64, device=device)
        md = MambaMetadata(0, 1, none, none, qsl.long(), tuple(qsl.tolist()), slots, has_init)
        kw["chunk_layout"] = md.ssd_chunk_layout(chunk_size)
    poison_allocator(device)
    y = impl(x, dt, dt_bias, A, B, C, D, qsl, pool[:, 0], slots, has_init, chunk_size, emit_out=emit_out,
             **ekw, **kw)
    tol = tol or TOL["ssd"][dtype]
    assert torch.equal(ref_pooled[tok_live], ref[0][tok_live])
    assert torch.equal(pool_ref.nan_to_num(0.0), want_pool.nan_to_num(0.0)), "pooled reference pool"
    errs = {"y": assert_close(y[tok_live], ref[0][tok_live], tol, "ssd pooled y"),
            "pool": assert_pool(pool, want_pool, tol, "ssd pooled pool")}
    # outside the rows' checkpoint 0 nothing moved, bit for bit
    moved = torch.zeros(pool.shape, dtype=torch.bool, device=pool.device)
    moved[slots[live], 0] = True
    assert torch.equal(pool[~moved].nan_to_num(0.0), want_pool[~moved].nan_to_num(0.0)), "ssd pooled: other slots"
    assert torch.equal(torch.isnan(pool[~moved]), torch.isnan(want_pool[~moved]))
    if e is not None:
        want_emit = torch.full((R, H, P, N), math.nan, device=device)
        want_emit[rows] = ref[2]
        assert torch.equal(emit_ref.nan_to_num(0.0), want_emit.nan_to_num(0.0)), "pooled reference emits"
        errs["emit"] = assert_pool(emit_out, want_emit, tol, "ssd pooled emit rows")
    return errs
