"""Cases for ``prepare_decode``: an implementation against a per-row Python oracle of the module
docstring, on random previous-step outputs, with poisoned destinations.

Run as a script (``TRITON_INTERPRET=1``: the Triton kernel on CPU) it prints one ``CASE name OK|FAIL``
line per case; tests/engine/test_decode_prep.py runs it, and imports ``check`` for the torch twin
and for CUDA.
"""
from __future__ import annotations

import sys
import traceback

import numpy as np
import torch

from hybrid_engine.step.decode_prep import DecodeDest, PrevOutputs, prepare_decode_ref
from hybrid_engine.mamba_cache import NULL_SLOT

POISON = -7


def oracle(staged, n, width, prev, R, M, bs, k):
    """Per-row loops over Python ints: {field: list} for every destination field. K is this step's
    width; the previous step's ``sampled`` may be wider or narrower (adaptive speculation)."""
    s = 1 + k
    several = prev.sampled.shape[1] > 1           # the previous step may have kept several tokens
    st = staged.tolist()
    sampled, nv, ns, dr = (prev.sampled.tolist(), prev.num_valid.tolist(), prev.next_start.tolist(),
                           prev.drafts.tolist())
    out = {f: [] for f in ("ids", "pos", "smap", "seq", "bt", "dslot", "acc", "start", "drafts", "next")}
    for r in range(R):
        if r >= n:
            out["ids"] += [0] * s
            out["pos"] += [0] * s
            out["smap"] += [0] * s
            out["seq"].append(s)
            out["bt"].append([0] * M)
            out["dslot"].append(NULL_SLOT)
            out["acc"].append(1)
            continue
        p, slot = st[r], st[n + r]
        bt = st[2 * n + r * width: 2 * n + (r + 1) * width]
        start = ns[p]
        a = max(nv[p], 1) if several else 1
        ids = [sampled[p][a - 1]] + [max(d, 0) for d in (dr[p] if k else [])]
        for j in range(s):
            pos = start + j
            out["ids"].append(ids[j])
            out["pos"].append(pos)
            out["smap"].append(bt[pos // bs] * bs + pos % bs)
        out["seq"].append(start + s)
        out["bt"].append(bt + [0] * (M - width))
        out["dslot"].append(slot)
        out["acc"].append(a)
        out["start"].append(start)
        if k:
            out["drafts"].append(list(dr[p]))
        else:
            out["next"].append(start + 1)
    return out


def make_case(seed, k, n, bp, R, width, M, bs, device, sp=None):
    """``sp``: columns of the previous step's sampled tokens (default 1 + k)."""
    g = np.random.default_rng(seed)
    s = 1 + k if sp is None else sp
    sampled = g.integers(0, 1000, (bp, s))
    nv = g.integers(0, s + 1, bp)                       # 0 happens for rows that sampled nothing
    for i in range(bp):
        sampled[i, nv[i]:] = -1
    next_start = g.integers(0, bs * width - (1 + k), bp)   # every position stays inside the table row
    drafts = np.where(g.random((bp, k)) < 0.3, -1, g.integers(0, 1000, (bp, k)))
    prev_idx = g.permutation(bp)[:n]
    slots = g.permutation(np.arange(1, 4 * n + 2))[:n]
    bt = g.integers(1, 10_000, (n, width))
    staged = np.concatenate([prev_idx, slots, bt.ravel()]).astype(np.int64)
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
    prev = PrevOutputs(t(sampled), t(nv), t(next_start), t(drafts))
    return t(staged), prev


def poisoned_dest(R, M, s, device, extra=0):
    p64 = lambda m: torch.full((m,), POISON, dtype=torch.int64, device=device)  # noqa: E731
    return DecodeDest(p64(R * s + extra), p64(R * s + extra), p64(R * s + extra),
                      torch.full((R,), POISON, dtype=torch.int32, device=device),
                      torch.full((R, M), POISON, dtype=torch.int32, device=device), p64(R), p64(R))


def check(impl, *, seed=0, k=0, n=5, bp=8, R=None, width=3, M=None, bs=4, device="cpu", sp=None):
    R = n if R is None else R
    M = width if M is None else M
    s = 1 + k
    staged, prev = make_case(seed, k, n, bp, R, width, M, bs, device, sp)
    dest = poisoned_dest(R, M, s, device, extra=3)
    start = torch.full((n,), POISON, dtype=torch.int64, device=device)
    drafts = torch.full((n, k), POISON, dtype=torch.int64, device=device) if k else None
    nxt = None if k else torch.full((n,), POISON, dtype=torch.int64, device=device)
    impl(staged, n, width, prev, dest, block_size=bs, num_spec=k, start_out=start, drafts_out=drafts,
         next_start_out=nxt)
    want = oracle(staged.cpu(), n, width, PrevOutputs(*(x.cpu() for x in prev.__dict__.values())), R, M, bs, k)
    got = {"ids": dest.input_ids[:R * s], "pos": dest.positions[:R * s], "smap": dest.slot_mapping[:R * s],
           "seq": dest.seq_lens, "bt": dest.block_tables, "dslot": dest.decode_slots, "acc": dest.num_accepted,
           "start": start, "drafts": drafts if k else torch.zeros(0), "next": nxt if not k else torch.zeros(0)}
    for f, w in want.items():
        g_ = got[f].cpu().tolist()
        assert g_ == w, f"{f}: got {g_} want {w}"
    # nothing past the R*s tokens is written
    for f in (dest.input_ids, dest.positions, dest.slot_mapping):
        assert (f[R * s:] == POISON).all(), "wrote past the destination rows"


CASES = {
    "k0": dict(k=0, n=5, bp=8),
    "k0_pad": dict(k=0, n=3, bp=6, R=8, width=2, M=5),
    "k1": dict(k=1, n=4, bp=4),
    "k3_pad": dict(k=3, n=5, bp=9, R=8, width=4, M=7),
    "k8": dict(k=8, n=2, bp=3, R=4, width=6, M=6, bs=2),
    "n1": dict(k=2, n=1, bp=1, R=1),
    "wide": dict(k=0, n=3, bp=3, R=4, width=40, M=600, bs=2),
    # adaptive speculation: this step's width differs from the previous step's
    "k0_after_k3": dict(k=0, n=4, bp=6, R=8, sp=4),
    "k2_after_k0": dict(k=2, n=4, bp=5, R=4, sp=1),
    "k3_after_k1": dict(k=3, n=3, bp=4, R=8, width=4, M=6, sp=2),
}


def with_header(kernel):
    """The kernel in header mode: [N, W] prepended to the staged array, and 0 passed for both
    arguments, so a right answer proves they were read from the header."""
    def run(staged, n, width, *a, **kw):
        head = torch.tensor([n, width], dtype=torch.int64, device=staged.device)
        return kernel(torch.cat([head, staged]), 0, 0, *a, header=True, **kw)
    return run


def main() -> int:
    from hybrid_engine.step.triton_decode_prep import triton_prepare_decode
    from triton_interpret import claimed, start_launch_log
    start_launch_log()
    for name, kw in CASES.items():
        if not claimed(name):
            continue
        for seed in range(3):
            try:
                check(triton_prepare_decode, seed=seed, **kw)
                check(with_header(triton_prepare_decode), seed=seed, **kw)
                check(prepare_decode_ref, seed=seed, **kw)
            except Exception:
                print(f"CASE {name} FAIL {traceback.format_exc().splitlines()[-1]}")
                break
        else:
            print(f"CASE {name} OK -")
    return 0


if __name__ == "__main__":
    sys.exit(main())
