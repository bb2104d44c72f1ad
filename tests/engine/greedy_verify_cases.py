"""Cases for ``greedy_verify`` (the fused verify step's verification): an implementation against a
per-row Python oracle of its docstring, on random logits with planted drafts, ties, NaN / +inf /
all -inf positions, and poisoned outputs.

Run as a script (``TRITON_INTERPRET=1``: the Triton kernels on CPU) it prints one ``CASE name OK|FAIL``
line per case; tests/engine/test_greedy_verify.py runs it and imports ``check`` for the torch twin
and for CUDA (tests/gpu/test_decode_prep_cuda.py).
"""
from __future__ import annotations

import math
import sys

import torch

from hybrid_engine.step.step_io import NONFINITE

POISON = -7


def oracle(logits, drafts, start, coins=None):
    """Per-row loops: (tokens, num_valid, next_start, payload, bad) as lists. A position's argmax is
    torch's first index of the maximum with NaN counted as +inf; a position is non-finite when that
    maximum is NaN, +inf or -inf. ``coins`` [B, k] bool (forced acceptance): a draft is accepted
    on its coin instead of on equality, and an accepted column emits the draft (the argmax where
    the draft is -1)."""
    B, k = drafts.shape
    rows = logits.view(B, 1 + k, -1)
    out = {"tok": [], "nv": [], "ns": [], "pay": [], "bad": []}
    for b in range(B):
        argmax, bad = [], False
        for j in range(1 + k):
            row = rows[b, j]
            best = int(torch.where(row.isnan(), math.inf, row).argmax())
            m = row[best].item()
            bad |= math.isnan(m) or math.isinf(m)
            argmax.append(best)
        n_acc = 0
        if coins is None:
            while n_acc < k and drafts[b, n_acc].item() == argmax[n_acc]:
                n_acc += 1
            tok = [argmax[j] if j <= n_acc else -1 for j in range(1 + k)]
        else:
            while n_acc < k and bool(coins[b, n_acc]):
                n_acc += 1
            emit = [int(d) if d >= 0 else a for d, a in zip(drafts[b].tolist(), argmax)]
            tok = [emit[j] if j < n_acc else (argmax[j] if j == n_acc else -1) for j in range(1 + k)]
        out["tok"].append(tok)
        out["nv"].append(n_acc + 1)
        out["ns"].append(start[b].item() + n_acc + 1)
        pay = tok + drafts[b].tolist()
        out["pay"].append([NONFINITE] * len(pay) if bad else pay)
        out["bad"].append(bad)
    return out


def make_inputs(B, k, V, *, seed=0, accept=0.6, ties=False, nonfinite=False, dtype=torch.float32, device="cpu"):
    """Random logits [B*(1+k), V], drafts that follow the argmax with probability ``accept`` per
    position (else a wrong token or -1), starts; optionally planted ties and non-finite positions."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B * (1 + k), V, generator=g)
    if ties:          # the maximum twice in a row: the first index must win
        for r in range(0, B * (1 + k), 2):
            if ties == "across_chunks":           # one in the first 4096-column chunk, one after it
                i, j = int(torch.randint(0, 4096, (1,), generator=g)), int(torch.randint(4096, V, (1,), generator=g))
            else:
                i, j = sorted(torch.randperm(V, generator=g)[:2].tolist())
            logits[r, i] = logits[r, j] = logits[r].max() + 1.0
    if nonfinite:     # rows 1.. get NaN / +inf / all -inf in one position
        for b, kind in zip(range(1, B), ("nan", "inf", "-inf")):
            r = b * (1 + k) + int(torch.randint(0, 1 + k, (1,), generator=g))
            if kind == "nan":
                logits[r, int(torch.randint(0, V, (1,), generator=g))] = float("nan")
            elif kind == "inf":
                logits[r, int(torch.randint(0, V, (1,), generator=g))] = float("inf")
            else:
                logits[r] = float("-inf")
    logits = logits.to(dtype)
    am = logits.float().view(B, 1 + k, V).argmax(-1)
    drafts = am[:, :k].clone()
    u = torch.rand(B, k, generator=g)
    drafts[u > accept] = (drafts[u > accept] + 1) % V
    drafts[(u > accept) & (torch.rand(B, k, generator=g) < 0.3)] = -1
    start = torch.randint(0, 1000, (B,), generator=g)
    return logits.to(device), drafts.to(device), start.to(device)


CASES = {
    "b1_k3_v4096": dict(B=1, k=3, V=4096),
    "b8_k3_v4096_ties": dict(B=8, k=3, V=4096, ties=True),
    "b5_k1_v5000_chunks": dict(B=5, k=1, V=5000),
    "b4_k5_v9000_nonfinite": dict(B=4, k=5, V=9000, nonfinite=True),
    "b3_k2_v300_f16": dict(B=3, k=2, V=300, dtype=torch.float16),
    "b6_k4_all_accept": dict(B=6, k=4, V=1000, accept=1.0),
    "b2_k7_v9000_ties_across_chunks": dict(B=2, k=7, V=9000, ties="across_chunks", accept=0.9),
    "b3_k2_v5000_bf16": dict(B=3, k=2, V=5000, dtype=torch.bfloat16),
    # width 0: a model drafter's fused step while adaptive speculation rests every row
    "b4_k0_v5000": dict(B=4, k=0, V=5000),
    # forced acceptance (benchmark only): coins decide, -1 drafts emit the argmax, wrong drafts pass
    "forced_b8_k3_v5000": dict(B=8, k=3, V=5000, forced=0.7),
    "forced_b3_k5_v300_f16_ties": dict(B=3, k=5, V=300, dtype=torch.float16, ties=True, forced=0.75, accept=0.2),
    "forced_b5_k2_v9000_nonfinite": dict(B=5, k=2, V=9000, nonfinite=True, forced=0.5),
}


def check(impl, *, B, k, V, seed=0, device="cpu", buffer_rows=None, forced=None, **kw):
    """Run ``impl`` (greedy_verify or its twin) into poisoned outputs wider than needed (the
    parity buffers are [Bmax, 1+K]) and compare with the oracle. ``forced``: coins passed with that
    probability (``accept=``, forced acceptance). Returns a detail string."""
    from hybrid_engine.step.triton_greedy_verify import chunk_buffers
    logits, drafts, start = make_inputs(B, k, V, seed=seed, device=device, **kw)
    coins, forced_kw = None, {}
    if forced is not None:       # the coins of spec.rejection (the kernel draws them itself)
        from hybrid_engine.spec.rejection import forced_accept_mask
        keys = torch.randint(0, 1 << 40, (B,), generator=torch.Generator().manual_seed(seed + 100))
        coins = forced_accept_mask(forced, keys, start.cpu() + 1, k)
        assert coins.any() and not coins.all(), "a forced case needs passed and failed coins"
        forced_kw = dict(forced_rate=forced, forced_keys=keys.to(device))
    want = oracle(logits.float().cpu(), drafts.cpu(), start.cpu(), coins)
    K = k + 2                                                 # buffers sized for a wider K
    tok = torch.full((B + 2, 1 + K), POISON, dtype=torch.int64, device=device)
    nv = torch.full((B + 2,), POISON, dtype=torch.int64, device=device)
    ns = torch.full_like(nv, POISON)
    pay = torch.full((B + 2, 1 + 2 * k), POISON, dtype=torch.int64, device=device)
    impl(logits, drafts, start, tokens_out=tok[:B, :1 + k], num_valid_out=nv[:B], next_start_out=ns[:B],
         payload_out=pay[:B], chunks=chunk_buffers(buffer_rows or B * (1 + k), V, device),
         **forced_kw)
    good = [b for b in range(B) if not want["bad"][b]]        # a non-finite row's tokens are unspecified
    assert pay[:B].tolist() == want["pay"], f"payload {pay[:B].tolist()} != {want['pay']}"
    assert [tok[b, :1 + k].tolist() for b in good] == [want["tok"][b] for b in good], "tokens"
    assert [nv[b].item() for b in good] == [want["nv"][b] for b in good], "num_valid"
    assert [ns[b].item() for b in good] == [want["ns"][b] for b in good], "next_start"
    assert (tok[B:] == POISON).all() and (tok[:B, 1 + k:] == POISON).all(), "wrote past its rows / columns"
    assert (nv[B:] == POISON).all() and (ns[B:] == POISON).all() and (pay[B:] == POISON).all(), "wrote past B"
    return f"accepted {sum(want['nv'][b] - 1 for b in good)} bad {sum(want['bad'])}"


if __name__ == "__main__":
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpret import case_main
    from hybrid_engine.step.triton_greedy_verify import greedy_verify
    torch.set_num_threads(1)
    sys.exit(case_main(CASES, sys.argv[1:], run=lambda c: check(greedy_verify, **c)))
