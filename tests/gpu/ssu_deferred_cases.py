"""The deferred state update's case (CONTRACT item 4b), imported by tests/mamba_cache/test_ssu_deferred.py
(the torch reference), the interpreter subprocess (interpret_cases.py) and
tests/gpu/test_kernels_ssu_norm.py (CUDA); not a test module itself. Inputs and helpers are
kernel_cases.py's."""
from __future__ import annotations

import math

import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from kernel_cases import _gen, _ssu_case, assert_close, poison_allocator


def check_ssu_deferred(impl, device, dtype, N, K, steps=5, gated=False, H=4, G=2, P=16, Nst=16,
                       dt_limit=(0.0, math.inf), seed=0, out_tol=None):
    """CONTRACT item 4b: ``impl`` (the state update's signature, plain or gated, with ``pending``)
    on a deferred pool against the same ``impl`` on a checkpointed pool, over ``steps`` verify
    steps of random widths s in 1..1+K and random accepted counts (the first step 1, then up to
    the previous width), the rows in a new order each step: every y bit for bit, and after each step the deferred state equals
    checkpoint 0 bit for bit. Both pools start NaN wherever no live slot owns, the pending inputs
    NaN everywhere (a replay that read an input no verify stored would turn the state NaN);
    NaN places must stay NaN in both (the null slot and unused slots are never written).
    out_tol: compare y within it instead (the public gated op, whose deferred verify takes the
    two-kernel path); the states stay bit for bit."""
    from hybrid_engine.mamba_cache.ops.state_update import PendingInputs, pending_blocks
    g = _gen(seed)
    I = H * P
    x, dt, B, C, dt_bias, A, D, slots, pool, _ = _ssu_case(g, device, dtype, N, 1 + K, K, H, G, P, Nst)
    live = slots[slots != NULL_SLOT].long()
    ok = (slots != NULL_SLOT).to(device)
    ckpt = pool.clone()
    state = pool[:, :1].clone()                        # [S, 1, H, P, N]: checkpoint 0 (NaN outside live slots)
    S, nb = pool.shape[0], pending_blocks(P, Nst)
    nan = lambda *shape: torch.full((S, K, H, *shape), math.nan, dtype=dtype, device=device)  # noqa: E731
    pending = PendingInputs(x=nan(P), dt=nan(nb), B=nan(nb, Nst))
    w = (1 + 0.1 * torch.randn(I, generator=g)).to(dtype).to(device)
    prev_s = 1
    for step in range(steps):
        if step:        # rows change places between steps (the engine's batches do)
            slots = slots[torch.randperm(N, generator=g).to(slots.device)]
            ok = (slots != NULL_SLOT).to(device)
        s = int(torch.randint(1, K + 2, (), generator=g))
        acc = torch.randint(1, prev_s + 1, (N,), generator=g, dtype=torch.int32).to(device)
        rnd = lambda *shape: torch.randn(*shape, generator=g).to(dtype).to(device)  # noqa: E731
        x, B, C = rnd(N, s, H, P), rnd(N, s, G, Nst), rnd(N, s, G, Nst)
        dt = (torch.randn(N, s, H, generator=g) * 0.5).to(dtype).to(device)
        z = rnd(N, s, I)
        extra = (z, w, I // G, 1e-5) if gated else ()
        outs = []
        for p_, pend in ((ckpt, None), (state, pending)):
            poison_allocator(device)
            if gated:
                outs.append(impl(p_, x, dt, dt_bias, A, B, C, D, slots, acc, *extra, dt_limit, pending=pend))
            else:
                outs.append(impl(p_, x, dt, dt_bias, A, B, C, D, slots, acc, dt_limit, out_dtype=dtype,
                                 pending=pend))
        y_ckpt, y_def = outs
        if out_tol is None:
            assert torch.equal(y_def[ok], y_ckpt[ok]), f"step {step}: deferred y differs from the checkpointed"
        else:
            assert_close(y_def[ok], y_ckpt[ok], out_tol, f"step {step}: deferred y")
        assert bool(torch.isfinite(y_def[ok]).all()), f"step {step}: a replay read an input never stored"
        assert torch.equal(state[live, 0], ckpt[live, 0]), f"step {step}: deferred state != checkpoint 0"
        prev_s = s
    dead = torch.ones(S, dtype=torch.bool)
    dead[live] = False
    dead = dead.to(device)
    assert bool(torch.isnan(state[dead]).all()) and bool(torch.isnan(ckpt[dead]).all()), "a dead slot was written"
    for t in (pending.x, pending.dt, pending.B):
        assert bool(torch.isnan(t[dead]).all()), "pending inputs of a dead slot were written"
    return {"y": 0.0, "state": 0.0}
