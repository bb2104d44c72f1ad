"""The n-gram drafter's Triton kernel against its torch path (the oracle), step by step.

``compare(device, ...)`` drives two drafters (backend "torch" and "triton") with the same random
requests and steps and checks, after every propose, that drafts, history and lengths are equal.
Used by tests/spec/test_ngram_triton.py (CPU, run as a script under TRITON_INTERPRET=1, which
must be set before Triton is imported: it prints ``CASE <name> OK|FAIL <detail>`` lines) and by
tests/gpu/test_ngram_cuda.py (CUDA, larger sizes, imported).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import numpy as np
import torch
from triton_interpret import case_main

from hybrid_engine.spec.drafters import DraftContext
from hybrid_engine.spec.drafters.ngram import NgramDrafter


def make_ctx(slots, sampled, num_valid, input_pos, width, device) -> DraftContext:
    """A DraftContext with the fields the n-gram drafter reads (sampled: [B, width])."""
    kw = {f.name: None for f in dataclasses.fields(DraftContext)}
    t = lambda x: torch.as_tensor(np.asarray(x, dtype=np.int64), device=device)  # noqa: E731
    kw.update(req_ids=tuple(f"r{x}" for x in slots), slots=t(slots),
              sampled=t(np.asarray(sampled, dtype=np.int64).reshape(-1, width)),
              num_valid=t(num_valid), input_pos=t(input_pos))
    return DraftContext(**kw)


def _stream(rng, n: int, vocab: int, kind: str) -> list[int]:
    """n tokens: 'random' over a small vocabulary, 'periodic' (a short random motif repeated,
    with rare flips): many matches of every n, and ties, or 'holes': random with -1 tokens, which
    match the -1 read before position 0 (not engine input: the search must still equal torch's)."""
    if kind == "holes":
        return rng.integers(-1, vocab - 1, n).tolist()
    if kind == "periodic":
        motif = rng.integers(0, vocab, int(rng.integers(1, 5)))
        out = np.resize(motif, n)
        flip = rng.random(n) < 0.05
        out[flip] = rng.integers(0, vocab, int(flip.sum()))
        return out.tolist()
    return rng.integers(0, vocab, n).tolist()


def compare(device, *, k: int, min_n: int, max_n: int, num_slots: int = 6, max_len: int = 48,
            window: int | None = None, steps: int = 12, seed: int = 0, vocab: int = 4,
            kind: str = "random", init_len: tuple[int, int] = (0, 12), odd_pos: float = 0.0,
            block: int | None = None, restart: float = 0.1) -> int:
    """Run ``steps`` proposes on both backends; returns the number of draft tokens proposed (!= -1).

    Rows: a random subset of slots (slot 0 included, like the engine's null slot row), each with
    a in [0, 1+K] valid sampled tokens followed by garbage. ``input_pos`` is the position of the
    last valid token (the engine's rule); with probability ``odd_pos`` it is instead moved back
    (a rewind: length shrinks, stale tokens stay in the row) or forward (a gap of -1 cells, or
    positions past max_len that are dropped). Slots restart with a fresh history of
    ``init_len`` tokens with probability ``restart`` (and when nearly full)."""
    rng = np.random.default_rng(seed)
    dev = torch.device(device)
    kw = dict(num_spec=k, min_n=min_n, max_n=max_n, num_slots=num_slots, max_len=max_len,
              device=dev, window=window)
    ref = NgramDrafter(backend="torch", **kw)
    tri = NgramDrafter(backend="triton", **kw)
    assert tri.backend == "triton" and ref.backend == "torch"
    if block is not None:
        from hybrid_engine.spec.drafters.triton_ngram import NgramTritonKernel
        tri._kernel = NgramTritonKernel(k, min_n, tri._m, max_len, tri.window, block=block)
    lens = np.zeros(num_slots, dtype=np.int64)          # host mirror of the lengths (for positions)
    proposed = 0
    for step in range(steps):
        for s in range(num_slots):
            if step == 0 or rng.random() < restart or lens[s] > max_len - 2 - k:
                toks = _stream(rng, int(rng.integers(*init_len)), vocab, kind)
                ref.add_request(s, toks)
                tri.add_request(s, toks)
                lens[s] = min(len(toks), max_len)
        nrows = int(rng.integers(0, num_slots + 1)) if step else num_slots
        rows = rng.permutation(num_slots)[:nrows]
        slots, sampled, nvalid, pos = [], [], [], []
        for s in rows:
            a = int(rng.integers(0, k + 2))
            toks = _stream(rng, k + 1, vocab, kind)
            garbage = rng.integers(-1, vocab + 3, k + 1 - a).tolist()
            p = int(lens[s]) + a - 1                     # the last valid token's position
            if a and rng.random() < odd_pos:
                p = int(rng.integers(a - 1, max_len + 3))  # rewind, gap or past the end
            if a:
                lens[s] = min(p + 1, max_len)
            else:
                p = int(rng.integers(0, 2 * max_len))      # ignored for rows that sampled nothing
            slots.append(int(s))
            sampled.append(toks[:a] + garbage)
            nvalid.append(a)
            pos.append(p)
        ctx = make_ctx(slots, sampled, nvalid, pos, k + 1, dev)
        d_ref, _ = ref.propose(ctx)
        d_tri, _ = tri.propose(ctx)
        where = f"step {step} rows {slots} a {nvalid} pos {pos}"
        assert d_tri.shape == d_ref.shape == (nrows, k) and d_tri.dtype == torch.int64, where
        if not torch.equal(d_tri, d_ref):
            bad = (d_tri != d_ref).any(1).nonzero().flatten().tolist()
            b = bad[0]
            s = slots[b]
            raise AssertionError(f"{where}: drafts differ at rows {bad}: triton {d_tri[b].tolist()} "
                                 f"torch {d_ref[b].tolist()} (slot {s}, length {ref.length[s].item()}, "
                                 f"history {ref.history[s, :ref.length[s]].tolist()})")
        assert torch.equal(tri.length, ref.length), \
            f"{where}: lengths {tri.length.tolist()} != {ref.length.tolist()}"
        assert torch.equal(tri.history, ref.history), f"{where}: histories differ"
        assert (tri._store[:, -1] == -1).all(), f"{where}: the NO_TOKEN column was written"
        assert (ref.length.cpu().numpy() == lens).all(), f"{where}: test bookkeeping"
        proposed += int((d_ref != -1).sum())
    return proposed


# name -> keyword arguments of compare (CPU interpreter sizes: small rows, few steps)
CASES = {
    "k1_n1": dict(k=1, min_n=1, max_n=1, seed=1),
    "k2_n2_4": dict(k=2, min_n=2, max_n=4, seed=2, vocab=3),
    "k3_n1_3": dict(k=3, min_n=1, max_n=3, seed=3),
    "k4_n1_5": dict(k=4, min_n=1, max_n=5, seed=4, vocab=2),
    "window_short": dict(k=3, min_n=1, max_n=3, window=7, max_len=40, seed=5, init_len=(5, 30)),
    "window_clips_m": dict(k=4, min_n=1, max_n=5, window=4, seed=6, vocab=3),   # m = 3 < max_n
    "min_n_above_m": dict(k=2, min_n=3, max_n=5, window=3, seed=7, vocab=2),    # never a match
    "window_2": dict(k=2, min_n=1, max_n=2, window=2, seed=8, vocab=2),         # m = 1, v = 1 only
    "short_rows": dict(k=3, min_n=1, max_n=3, init_len=(0, 4), steps=6, seed=9, vocab=2, restart=0.5),
    "periodic_ties": dict(k=4, min_n=1, max_n=4, kind="periodic", seed=10, vocab=3),
    "periodic_n2_3": dict(k=2, min_n=2, max_n=3, kind="periodic", seed=11, vocab=2, window=12),
    "odd_positions": dict(k=3, min_n=1, max_n=3, odd_pos=0.4, seed=12, max_len=24),
    "small_blocks": dict(k=3, min_n=1, max_n=4, block=4, seed=13, vocab=6, init_len=(10, 40),
                         max_len=64),
    "holes": dict(k=3, min_n=1, max_n=4, kind="holes", vocab=2, init_len=(0, 6), seed=15,
                  odd_pos=0.3, max_len=20, steps=16),
    "holes_min_n2": dict(k=2, min_n=2, max_n=3, kind="holes", vocab=2, init_len=(0, 5), seed=16,
                         window=6, max_len=16, steps=16),
    "small_blocks_window": dict(k=2, min_n=2, max_n=3, block=2, window=9, seed=14, vocab=3,
                                kind="periodic"),
}


def main(names) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"
    torch.set_num_threads(1)
    return case_main(CASES, names, lambda case: f"proposed={compare('cpu', **case)}")

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
