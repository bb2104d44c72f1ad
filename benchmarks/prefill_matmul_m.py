"""The 8B step's bf16 projections at prefill sizes: GPU ms of one step's matmuls per token count M
(issue 19's prefill-graph buckets). cuBLAS picks its kernel by M, so a padded bucket can cost more
than the rows it adds; this sweep shows which M are cheap.

Per M: the sum over the projections of one 8B step (lm_head left out: a prefill computes one logits
row), each weighted by its calls per step, timed by ``graph_ms`` (the calls captured in a CUDA
graph, as the prefill graphs run them) over weight copies beyond L2; with ``--eager`` also by CUDA
events around plain calls, to see whether capture changes cuBLAS's choice.

    python benchmarks/prefill_matmul_m.py [--m 296 300 304 ...] [--range 16 2048 8] [--eager] [--json f.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import event_ms, graph_ms  # noqa: E402
from benchmarks.gemv import SHAPES  # noqa: E402


def step_ms(m: int, weights: dict, eager: bool) -> float:
    total = 0.0
    for name, n, k, calls in SHAPES:
        if name == "lm_head":
            continue
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        fns = [lambda w=w: F.linear(x, w) for w in weights[name]]
        for f in fns:
            f()
        if eager:
            ms = min(event_ms(lambda: [f() for f in fns], 5) / len(fns) for _ in range(3))
        else:
            ms = graph_ms(fns, reps=2 * len(fns), replays=5)
        total += ms * calls
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="*", default=[])
    ap.add_argument("--range", type=int, nargs=3, default=None, metavar=("LO", "HI", "STEP"))
    ap.add_argument("--eager", action="store_true", help="also time without graph capture")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ms_list = sorted(set(args.m) | (set(range(*args.range)) if args.range else set()))
    weights = {}
    for name, n, k, _ in SHAPES:
        if name == "lm_head":
            continue
        copies = max(2, -(-120_000_000 // (n * k * 2)))     # >= 120 MB of copies: beyond the 50 MB L2
        weights[name] = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    rows = []
    print(f"{'M':>6} {'graph ms':>9} {'us/row':>7}" + ("  eager ms" if args.eager else ""))
    for m in ms_list:
        g = step_ms(m, weights, eager=False)
        row = dict(m=m, graph_ms=g)
        line = f"{m:6d} {g:9.3f} {1e3 * g / m:7.2f}"
        if args.eager:
            row["eager_ms"] = step_ms(m, weights, eager=True)
            line += f" {row['eager_ms']:9.3f}"
        rows.append(row)
        print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                   rows=rows), indent=1))


if __name__ == "__main__":
    main()
