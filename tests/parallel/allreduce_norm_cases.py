"""Cases for the fused tensor-parallel all-reduce + residual add + RMSNorm kernel
(``parallel/allreduce_norm.py``), one rank at a time in one process: the peers' side of the
protocol is staged by hand (their rows pushed into this rank's staging buffer, their flags raised
on this rank), the kernel runs as ``rank``, and the check covers every effect against the torch
reference: the outputs, its row pushed into every rank's buffer, the flags it raised on each peer,
the flags it consumed (back to 0), nothing written outside its slot / rows, and NaN rows when a peer never
signals (a bounded wait), with every later call NaN too (the ``broken`` word).

``two_processes`` runs the protocol between two real ranks: two processes, the interpreter in each,
sharing the buffers and flags, calls back to back over reused slots with either rank late in turn
(a missing flag reset fails it: stale rows).

Run as a script (``TRITON_INTERPRET=1``: the kernel on CPU) it prints one ``CASE name OK|FAIL`` line
per case; tests/parallel/test_allreduce_norm.py runs it, and tests/gpu/test_tensor_parallel_cuda.py
runs ``check`` natively on one GPU (the two-GPU run is in the same file).
"""
from __future__ import annotations

import sys

import torch

from hybrid_engine.parallel.allreduce_norm import allreduce_add_norm_ref, launch_allreduce_add_norm

POISON = 777.0


def check(*, rank, world, T, D, dtype, slot=1, slots=3, max_rows=8, missing_row=None, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: (torch.randn(*s, generator=g) * 2).to(dtype).to(device)   # noqa: E731 - O(1) values
    partials = [rnd(T, D) for _ in range(world)]                       # every rank's [T, D]
    residual, weight = rnd(T, D), rnd(D)
    staging = [torch.full((slots, max_rows, world, D), POISON, dtype=dtype, device=device) for _ in range(world)]
    flags = [torch.zeros(slots, max_rows, world, dtype=torch.int32, device=device) for _ in range(world)]
    for p in range(world):
        if p != rank:
            staging[rank][slot, :T, p] = partials[p]                   # the peer pushed its rows here
            flags[rank][slot, :T, p] = 1                               # ... and told this rank
    if missing_row is not None:
        flags[rank][slot, missing_row, (rank + 1) % world] = 0         # one peer never arrives
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)  # noqa: E731
    out = torch.full((T + 2, D), POISON, dtype=dtype, device=device)
    res_out = torch.full((T + 2, D), POISON, dtype=dtype, device=device)
    broken = torch.zeros(1, dtype=torch.int32, device=device)
    launch_allreduce_add_norm(partials[rank], residual, weight, 1e-5, rank=rank, world=world, slot=slot,
                              max_rows=max_rows, buf_ptrs=ptrs(staging), flag_ptrs=ptrs(flags), broken=broken,
                              max_spins=50, out=out[:T], residual_out=res_out[:T])
    want_out, want_res = allreduce_add_norm_ref(partials, residual, weight, 1e-5)
    ok = [r for r in range(T) if r != missing_row]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if dtype == torch.float32 or device != "cpu":
        assert torch.equal(res_out[ok], want_res[ok]), "new residual differs from residual + the rank-order sum"
    else:       # the interpreter rounds float32 -> bfloat16 its own way (two roundings of O(4) values)
        torch.testing.assert_close(res_out[ok].float(), want_res[ok].float(), rtol=2 ** -6, atol=0.25)
    torch.testing.assert_close(out[ok].float(), want_out[ok].float(), atol=tol, rtol=tol)
    assert (out[T:] == POISON).all() and (res_out[T:] == POISON).all(), "wrote past its rows"
    assert broken.item() == (missing_row is not None), "the broken word does not say whether a wait gave up"
    if missing_row is not None:
        assert out[missing_row].isnan().all(), "a row whose peer never signalled is not NaN"
    for p in range(world):          # this rank's rows went into every buffer at [slot, :T, rank], nowhere else
        assert torch.equal(staging[p][slot, :T, rank], partials[rank]), f"rows not pushed to rank {p}"
        mask = torch.ones(slots, max_rows, world, dtype=torch.bool)
        mask[slot, :T, rank] = False
        if p == rank:
            mask[slot, :T] = False
        else:
            assert (staging[p][mask.to(device)] == POISON).all(), f"wrote outside its cells of rank {p}'s buffer"
    mask = torch.ones(slots, max_rows, world, dtype=torch.bool)
    mask[slot, :T] = False
    assert (staging[rank][mask.to(device)] == POISON).all(), "staged outside its slot / rows"
    for p in range(world):
        if p == rank:
            assert (flags[p] == 0).all(), "a consumed flag was not reset to 0"
        else:
            want = torch.zeros(slots, max_rows, world, dtype=torch.int32, device=device)
            want[slot, :T, rank] = 1
            assert torch.equal(flags[p], want), f"flags raised on peer {p} are wrong"
    if missing_row is not None:
        # from now on every call is NaN, even with every peer's flag raised (they are out of step)
        for p in range(world):
            if p != rank:
                flags[rank][slot, :T, p] = 1
        again = torch.full((T, D), POISON, dtype=dtype, device=device)
        launch_allreduce_add_norm(partials[rank], residual, weight, 1e-5, rank=rank, world=world, slot=slot,
                                  max_rows=max_rows, buf_ptrs=ptrs(staging), flag_ptrs=ptrs(flags), broken=broken,
                                  max_spins=50, out=again, residual_out=torch.empty_like(again))
        assert again.isnan().all(), "a call after a wait gave up is not NaN"
        assert (flags[rank] == 0).all(), "the later call did not consume its flags"
        return "NaN rows, broken word set, later calls NaN"
    return f"max |out - ref| {(out[ok].float() - want_out[ok].float()).abs().max().item():.2e}"


def _inputs(seed: int, world: int, T: int, D: int):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(T, D, generator=g) * 2 for _ in range(world)]
    return parts, torch.randn(T, D, generator=g) * 2, torch.randn(D, generator=g)


TWO_RANK_STEPS = [(3, 0), (5, 1), (2, 2), (4, 0), (1, 1), (5, 2), (3, 0), (2, 1)]    # (rows, slot)


def _rank_main(rank, world, staging, flags, steps, D, max_rows, results):
    """One rank of ``two_processes``: the calls of ``steps`` back to back, a rank delayed now and
    then, each checked against the reference; -> results[rank] = (errors, broken, flags left)."""
    import time
    torch.set_num_threads(1)
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)   # noqa: E731 - this process's mappings
    bp, fp = ptrs(staging), ptrs(flags)
    broken = torch.zeros(1, dtype=torch.int32)
    errors = []
    for i, (T, slot) in enumerate(steps):
        if (i + rank) % 3 == 0:
            time.sleep(0.2)                     # this rank arrives late; the other waits (or runs ahead)
        parts, res, w = _inputs(100 + i, world, T, D)
        out, r = launch_allreduce_add_norm(parts[rank], res, w, 1e-5, rank=rank, world=world, slot=slot,
                                           max_rows=max_rows, buf_ptrs=bp, flag_ptrs=fp, broken=broken,
                                           max_spins=10 ** 8)
        want_out, want_r = allreduce_add_norm_ref(parts, res, w, 1e-5)
        if not torch.equal(r, want_r):
            errors.append(f"call {i}: residual differs by {(r - want_r).abs().max().item():.3g}")
        elif not torch.allclose(out, want_out, atol=1e-5, rtol=1e-5):
            errors.append(f"call {i}: normed output differs by {(out - want_out).abs().max().item():.3g}")
    results[rank] = (errors, int(broken.item()), int(flags[rank].abs().sum().item()))


def two_processes(D=32, max_rows=8, slots=3, world=2):
    """The protocol between two real ranks: two processes (Triton's interpreter in each) sharing
    every rank's staging buffer and flags through shared memory, eight calls back to back over three
    slots with either rank late in turn; every call's result equals the reference on both ranks,
    no wait gives up, and every flag ends at 0."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    staging = [torch.full((slots, max_rows, world, D), POISON).share_memory_() for _ in range(world)]
    flags = [torch.zeros(slots, max_rows, world, dtype=torch.int32).share_memory_() for _ in range(world)]
    results = ctx.Manager().dict()
    procs = [ctx.Process(target=_rank_main, args=(r, world, staging, flags, TWO_RANK_STEPS, D, max_rows, results))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(240)
        if p.is_alive():
            p.kill()
            raise AssertionError("a rank did not finish in 240 s (deadlock?)")
    assert all(p.exitcode == 0 for p in procs), f"exit codes {[p.exitcode for p in procs]}"
    for r in range(world):
        errors, broken, raised = results[r]
        assert not errors, f"rank {r}: {errors}"
        assert broken == 0, f"rank {r}: a wait gave up"
        assert raised == 0, f"rank {r}: {raised} flags left raised"
    return f"{len(TWO_RANK_STEPS)} calls on {world} processes"


CASES = {
    "w2_rank0_bf16": dict(rank=0, world=2, T=3, D=64, dtype=torch.bfloat16),
    "w2_rank1_f32_odd_d": dict(rank=1, world=2, T=5, D=100, dtype=torch.float32),
    "w4_rank2_bf16_full_rows": dict(rank=2, world=4, T=8, D=48, dtype=torch.bfloat16, slot=2),
    # the last row: a wait that gives up turns the rows that start after it NaN too (the broken word)
    "w2_rank0_missing_peer": dict(rank=0, world=2, T=4, D=32, dtype=torch.float32, missing_row=3),
}

if __name__ == "__main__":
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpret import case_main
    torch.set_num_threads(1)
    sys.exit(case_main({**CASES, "two_processes": two_processes}, sys.argv[1:],
                       run=lambda c: c() if callable(c) else check(**c)))
