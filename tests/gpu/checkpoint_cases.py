"""Random cases for the prefix-cache checkpoint kernels against their torch twins (imported by
the interpreter subprocess of test_kernels_interpret.py and by test_checkpoint_kernels_cuda.py;
not a test module itself): the emit kernel (the SSM state after chosen tokens) and the conv-window
kernel. Same conventions as kernel_cases.py: fresh random inputs on ``device``, poisoned outputs
and pools, the measured error returned."""
from __future__ import annotations

import math

import torch

from kernel_cases import _clone_like, _conv_pool, _gen, _qsl, _slots, assert_close, assert_pool


def check_emit(impl, device, dtype, lens, emit, cs, H=4, G=2, P=20, N=10, seed=0, tol=None, rows=False):
    """``impl`` (triton_ssd_emit.emit_states) against ``emit_states_ref`` on random chunk
    quantities laid out as the SSD scan lays them out (a spare empty chunk row, as its T-bound
    grid has); the output is poisoned with NaN first. P, N off powers of two (masked tiles) and
    chunks longer than one dot step are the interesting cases. ``rows``: into shuffled rows of a
    larger NaN buffer (``out_rows``: the checkpoint rows), the spare rows left NaN."""
    from hybrid_engine.mamba_cache.ops.triton_common import next_pow2
    from hybrid_engine.mamba_cache.ops.triton_ssd_emit import emit_states_ref
    g = _gen(seed)
    T, BL = sum(lens), max(16, next_pow2(cs))
    x = torch.randn(T, H, P, generator=g).to(dtype).to(device)
    B = torch.randn(T, G, N, generator=g).to(dtype).to(device)
    qsl = _qsl(lens).to(device)
    counts = [-(-n // cs) for n in lens]
    cum = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    starts, q = [], 0
    for n, c in zip(lens, counts):
        starts += [(q + k * cs, min(cs, n - k * cs)) for k in range(c)]
        q += n
    NC = len(starts) + 1
    meta = torch.tensor(starts + [(T, 0)], dtype=torch.int32).to(device)
    dtc = (torch.rand(NC, H, BL, generator=g) * 0.5).to(device)
    cuma = torch.cumsum(-torch.rand(NC, H, BL, generator=g) * 0.2, -1).to(device)
    h_in = torch.randn(NC, H, P, N, generator=g).to(device)
    e = torch.tensor(emit, dtype=torch.int64).to(device)
    want = emit_states_ref(x, B, qsl, cum, meta, dtc, cuma, h_in, e, cs)
    if rows:
        R = len(emit) + 3
        out_rows = torch.randperm(R, generator=g)[:len(emit)].to(device)
        out = torch.full((R, H, P, N), float("nan"), device=device)
        got = impl(x, B, qsl, cum, meta, dtc, cuma, h_in, e, cs, out=out, out_rows=out_rows)
        assert got is out
        full = torch.full_like(out, float("nan"))
        full[out_rows] = want
        return {"emit": assert_pool(got, full, tol or 1e-5, "emit rows")}
    out = torch.full((len(emit), H, P, N), float("nan"), device=device)
    got = impl(x, B, qsl, cum, meta, dtc, cuma, h_in, e, cs, out=out)
    assert got is out
    return {"emit": assert_close(got, want, tol or 1e-5, "emit")}


def check_conv_windows(impl, device, dtype, lens, emits, C=24, W=4, K=3, seed=0, token_major=True, rows=False):
    """``impl`` (triton_conv_windows_before) against ``conv_windows_before_ref``: the conv window
    after each emit token, reading the pool's old window where the token is within W-2 of its
    chunk's start (rows with and without an initial state). The pool is NaN outside the rows'
    windows (a read of anything else shows), must stay untouched, and the output starts as NaN.
    ``emits``: (row, position in the row's chunk) pairs. ``rows``: into shuffled rows of a larger NaN
    buffer (``out_rows``: the checkpoint rows), the spare rows left NaN."""
    from hybrid_engine.mamba_cache.ops import conv_windows_before_ref
    g = _gen(seed)
    S = len(lens) + 3
    x = torch.randn(sum(lens), C, generator=g).to(dtype)
    pool = _conv_pool(S, C, W - 1 + K, dtype, token_major)
    slots = _slots(len(lens), S, g)
    init = torch.tensor([i % 2 == 0 for i in range(len(lens))])
    for r, s in enumerate(slots.tolist()):
        if init[r]:
            pool[s, :, :W - 1] = torch.randn(C, W - 1, generator=g).to(dtype)
    qsl = _qsl(lens, torch.int64)
    seq = torch.tensor([r for r, _ in emits], dtype=torch.int64)
    tok = torch.tensor([qsl[r].item() + p for r, p in emits], dtype=torch.int64)
    pool, x, qsl, slots, init, seq, tok = (t.to(device) for t in (pool, x, qsl, slots, init, seq, tok))
    want = conv_windows_before_ref(x, pool, W, qsl, slots, init, seq, tok)
    before = _clone_like(pool)
    if rows:
        R = len(emits) + 2
        out_rows = torch.randperm(R, generator=g)[:len(emits)].to(device)
        out = torch.full((R, C, W - 1), math.nan, dtype=dtype, device=device)
        got = impl(x, pool, W, qsl, slots, init, seq, tok, out=out, out_rows=out_rows)
        full = torch.full_like(out, math.nan)
        full[out_rows] = want
        want = full
    else:
        out = torch.full((len(emits), C, W - 1), math.nan, dtype=dtype, device=device)
        got = impl(x, pool, W, qsl, slots, init, seq, tok, out=out)
    assert got is out
    assert_pool(got, want, None, "conv windows (a copy: bit-exact; spare rows NaN)")
    assert_pool(pool, before, None, "conv pool")
    return {"windows": 0.0}


def check_restore(impl, device, dtype, L=3, R=5, S=6, C=40, W=4, K=2, H=3, P=5, N=7, slots=(4, 1, 5), rows=(2, 0, 4),
                  seed=0):
    """``impl`` (triton_restore.triton_restore_rows) against the torch twin, as
    ``MambaCheckpoints.restore`` calls it: checkpoint rows [L, R, C, W-1] into the pool's conv
    window columns 0..W-2 ([L, S, C, W-1+K], a strided, token-major view) and [L, R, H, P, N] float32 into the
    pool's SSM checkpoint 0 ([L, S, 1+K, H, P, N]). Pools start NaN: every other slot, column and
    checkpoint stays NaN, every restored element is bit-equal. A negative row (a padding entry)
    leaves its slot NaN."""
    from hybrid_engine.mamba_cache.checkpoints import restore_rows_ref
    g = _gen(seed)
    conv_rows = torch.randn(L, R, C, W - 1, generator=g).to(dtype).to(device)
    ssm_rows = torch.randn(L, R, H, P, N, generator=g).to(device)
    r = torch.tensor(rows, dtype=torch.int64, device=device)
    s = torch.tensor(slots, dtype=torch.int64, device=device)
    out = {}
    for name, src, pool, view in (
            # the pool keeps windows token-major in memory ([L, S, W-1+K, C] seen transposed), as
            # MambaPool does; the rows are channel-major
            ("conv", conv_rows, torch.full((L, S, W - 1 + K, C), float("nan"), dtype=dtype,
                                            device=device).transpose(-1, -2), lambda t: t[..., :W - 1]),
            ("ssm", ssm_rows, torch.full((L, S, 1 + K, H, P, N), float("nan"), device=device),
             lambda t: t[:, :, 0])):
        want = pool.clone()
        restore_rows_ref(src, view(want), r, s)
        impl(src, view(pool), r, s)
        out[name] = assert_pool(pool, want, None, f"restore {name}")
        for row, slot in zip(rows, slots):
            if row < 0:
                assert torch.isnan(view(pool)[:, slot]).all(), f"restore {name}: a padding entry wrote slot {slot}"
    return out
