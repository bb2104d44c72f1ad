"""Decode / verify attention against the length bound it is launched with: a large ``max_model_len``
must not slow short rows. Times ``triton_paged_attention`` (attention + split combine) for rows of
a given context under the default engine bound (max_model_len 8192, or the context when longer)
and under a bound of 262144, by ``graph_ms`` (launches captured in a CUDA graph, as the decode
graphs run them). ``--base FILE``: a second copy of ``attention/triton_attention.py`` (an older
tree's) timed in the same process, alternating, for a same-run ratio; every case is first checked
against the reference.

    python benchmarks/attn_decode_bound.py [--shapes nano 8b bench-large] [--ctx 500 2000 8000 32000]
        [--batches 1 8] [--queries 1 4] [--base _gpu/base/hybrid_engine/attention/triton_attention.py]
        [--json f.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import graph_ms  # noqa: E402
from hybrid_engine.attention.ops import paged_attention_ref  # noqa: E402
from hybrid_engine.attention.triton_attention import triton_paged_attention  # noqa: E402

# (query heads, KV heads, head dim, dtype): the published Nano and the 8B shapes, the bench-large
# target (float32, as benchmarks/spec_real.py serves it)
SHAPES = {"nano": (32, 2, 128, torch.bfloat16), "8b": (32, 8, 128, torch.bfloat16),
          "bench-large": (16, 4, 64, torch.float32)}
LARGE_BOUND = 262144
BS = 16


def load_base(path: str):
    spec = importlib.util.spec_from_file_location("base_triton_attention", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.triton_paged_attention


def inputs(shape: str, B: int, s: int, ctx: int, n_sets: int):
    """n_sets copies of a batch of B rows, s queries each after ctx keys (copies beyond L2)."""
    nH, nkv, hd, dt = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(ctx + B + s)
    seq = ctx + s
    nblk = -(-seq // BS)
    NB = n_sets * B * nblk + 1
    kc = torch.randn(NB, BS, nkv, hd, device="cuda", generator=g).to(dt)
    vc = torch.randn(NB, BS, nkv, hd, device="cuda", generator=g).to(dt)
    cols = LARGE_BOUND // BS + 8
    sets = []
    for k in range(n_sets):
        q = torch.randn(B * s, nH, hd, device="cuda", generator=g).to(dt)
        bt = torch.zeros(B, cols, dtype=torch.int32, device="cuda")
        bt[:, :nblk] = (1 + k * B * nblk + torch.arange(B * nblk, device="cuda", dtype=torch.int32)).view(B, nblk)
        qsl = torch.arange(0, B * s + 1, s, device="cuda", dtype=torch.int32)
        sl = torch.full((B,), seq, device="cuda", dtype=torch.int32)
        sets.append((q, qsl, sl, bt))
    return kc, vc, sets, hd ** -0.5, seq


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["nano", "8b", "bench-large"], choices=sorted(SHAPES))
    ap.add_argument("--ctx", type=int, nargs="+", default=[500, 2000, 8000, 32000])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the trees per case")
    ap.add_argument("--base", default=None, help="an older triton_attention.py to time beside this tree's")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    impls = {"new": triton_paged_attention}
    if args.base:
        impls = {"base": load_base(args.base), **impls}
    rows = []
    print(f"{torch.cuda.get_device_name()}; us per call (attention + combine), graph-timed, median of "
          f"{args.rounds} rounds", flush=True)
    for shape in args.shapes:
        for B in args.batches:
            for s in args.queries:
                for ctx in args.ctx:
                    kc, vc, sets, scale, seq = inputs(shape, B, s, ctx, n_sets=4)
                    q, qsl, sl, bt = sets[0]
                    ref = paged_attention_ref(q, kc, vc, qsl, sl, bt, scale, s, seq).float()
                    # the engine's graph bound: max_model_len (8192 by default, or one that fits the
                    # context) + 2 per query token; and a large max_model_len
                    bounds = {"default": max(8192, seq) + 2 * s, "262k": LARGE_BOUND + 2 * s}
                    row = dict(shape=shape, batch=B, queries=s, ctx=ctx)
                    times = {}
                    for bname, bound in bounds.items():
                        for name, fn in impls.items():
                            out = fn(q, kc, vc, qsl, sl, bt, scale, s, bound).float()
                            err = float((out - ref).abs().max() / ref.abs().max())
                            if err > (2e-2 if kc.dtype != torch.float32 else 1e-4):
                                raise AssertionError(f"{name} {shape} B={B} s={s} ctx={ctx} bound={bound}: err {err}")
                    for _ in range(args.rounds):
                        for bname, bound in bounds.items():
                            for name, fn in impls.items():
                                calls = [lambda a=a, fn=fn, bound=bound: fn(a[0], kc, vc, a[1], a[2], a[3], scale, s,
                                                                              bound) for a in sets]
                                for c in calls:
                                    c()
                                times.setdefault(f"{name}_{bname}", []).append(1e3 * graph_ms(calls))
                    for k, v in times.items():
                        row[k + "_us"] = round(statistics.median(v), 2)
                    rows.append(row)
                    print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                    del kc, vc, sets
                    torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
