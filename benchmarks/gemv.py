"""Decode-sized projections (M = 1..4 token rows) on the Nemotron-H-8B shapes: cuBLAS (F.linear)
versus the Triton kernels in hybrid_engine/models/skinny_linear.py over a config sweep (CUDA).

Timing: each call set is captured in a CUDA graph (20 calls, rotating over enough weight copies
that the working set exceeds L2) and replayed; median over replays; GB/s counts weight + x + y
bytes once. The summary weights each shape by its calls per 8B decode step.

    python benchmarks/gemv.py [--m 1 4] [--tp 1 2] [--model 8b|nano|bench-large] [--dtype bfloat16|float32]
                              [--out table.md] [--json f.json]

``--dtype float32`` times cuBLAS against the FMA kernel only (the float32 rule, ``skinny_linear_f32``,
uses it for 1-8 rows); ``--model bench-large`` takes the projections of the trained spec-benchmark
target (benchmarks/train/models.py).

``--tp 2`` takes each rank's shapes under tensor parallelism of 2 (column-parallel projections
halve N, row-parallel ones halve K). The "rule" row is what ``skinny_linear`` dispatches to today.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import sweep_header, time_candidates  # noqa: E402
from hybrid_engine.models.skinny_linear import (skinny_linear, skinny_linear_dot, skinny_linear_f32,  # noqa: E402
                                                skinny_linear_fma)

# (name, N, K, calls per decode step of the 8B shape)
SHAPES = [("mamba in_proj", 18560, 4096, 24), ("mamba out_proj", 4096, 8192, 24),
          ("mlp up_proj", 21504, 4096, 24), ("mlp down_proj", 4096, 21504, 24),
          ("attn q/o_proj", 4096, 4096, 8), ("attn k/v_proj", 1024, 4096, 8),
          ("lm_head", 131072, 4096, 1)]
DOT_CFGS = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=st)
            for bn, bk, nw, st in ((32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4),
                                   (64, 256, 4, 3), (64, 128, 4, 6), (128, 128, 4, 4),
                                   (32, 512, 4, 2), (16, 256, 4, 4), (16, 512, 4, 3))]
FMA_CFGS = [dict(block_n=bn, block_k=bk, num_warps=nw)
            for bn, bk, nw in ((4, 512, 4), (8, 512, 4), (8, 1024, 8), (16, 256, 4),
                               (16, 512, 8), (32, 256, 8), (4, 1024, 4), (2, 1024, 4),
                               (4, 2048, 8), (8, 2048, 8), (2, 2048, 4), (2, 512, 4), (4, 256, 4),
                               (8, 256, 4), (1, 1024, 4), (2, 1024, 8), (4, 512, 8), (4, 1024, 8),
                               (1, 2048, 4), (2, 2048, 8), (1, 512, 2))]
# the Nemotron 3 Nano 30B-A3B shapes that go through skinny_linear (its routed and shared experts run
# the MoE kernels: benchmarks/moe_gemv_sweep.py); hidden 2688 is not a multiple of the K tiles
NANO_SHAPES = [("mamba in_proj", 10304, 2688, 23), ("mamba out_proj", 2688, 4096, 23),
               ("attn q_proj", 4096, 2688, 6), ("attn k/v_proj", 256, 2688, 12), ("attn o_proj", 2688, 4096, 6),
               ("lm_head", 131072, 2688, 1)]
# the bench-large preset's target (hidden 1024, 8 Mamba / 7 MLP / 2 attention blocks; its MoE block runs
# the MoE kernels)
BENCH_LARGE_SHAPES = [("mamba in_proj", 5152, 1024, 8), ("mamba out_proj", 1024, 2048, 8),
                      ("mlp up_proj", 4096, 1024, 7), ("mlp down_proj", 1024, 4096, 7),
                      ("attn q/o_proj", 1024, 1024, 4), ("attn k/v_proj", 256, 1024, 4),
                      ("lm_head", 16384, 1024, 1)]
# per shape: which dim tensor parallelism splits (column-parallel: N, row-parallel: K)
TP_SPLIT = {"mamba in_proj": "N", "mamba out_proj": "K", "mlp up_proj": "N", "mlp down_proj": "K",
            "attn k/v_proj": "N", "lm_head": "N"}


def tp_shapes(tp: int):
    """The 8B shapes one rank of ``tp`` sees (q_proj and o_proj split differently: two rows)."""
    if tp == 1:
        return SHAPES
    out = []
    for name, N, K, per_step in SHAPES:
        if name == "attn q/o_proj":
            out += [("attn q_proj", N // tp, K, per_step // 2), ("attn o_proj", N, K // tp, per_step // 2)]
        else:
            out.append((name, N // tp, K, per_step) if TP_SPLIT[name] == "N" else (name, N, K // tp, per_step))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=[1])
    ap.add_argument("--model", choices=["8b", "nano", "bench-large"], default="8b",
                    help="whose projection shapes (nano, bench-large: TP=1 only)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    if args.model != "8b" and args.tp != [1]:
        ap.error(f"--model {args.model} takes --tp 1 only")
    dtype = getattr(torch, args.dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    head, bw = sweep_header()
    res = []
    shapes = ([(f"{name} (TP={tp})" if tp > 1 else name, N, K, ps) for tp in args.tp for name, N, K, ps in tp_shapes(tp)]
              if args.model == "8b" else NANO_SHAPES if args.model == "nano" else BENCH_LARGE_SHAPES)
    rule = skinny_linear_f32 if dtype == torch.float32 else skinny_linear
    for name, N, K, per_step in shapes:
        wbytes = N * K * esize
        ncopy = max(1, min(8, -(-(200 << 20) // wbytes)))      # > L2 working set
        ws = [(torch.randn(N, K, device="cuda") * 0.02).to(dtype) for _ in range(ncopy)]
        for M in args.m:
            x = torch.randn(M, K, device="cuda").to(dtype)
            ref = F.linear(x.double(), ws[0].double()).float()
            nbytes = wbytes + (M * K + M * N) * esize
            cands = [("cublas", {}, lambda w, x=x: F.linear(x, w)), ("rule", {}, lambda w, x=x: rule(x, w))]
            if dtype != torch.float32:        # float32 tl.dot (ieee) is slower than cuBLAS: not swept
                cands += [("dot", c, lambda w, x=x, c=c: skinny_linear_dot(x, w, **c)) for c in DOT_CFGS]
            if M <= 8:
                cands += [("fma", c, lambda w, x=x, c=c: skinny_linear_fma(x, w, **c))
                          for c in FMA_CFGS]
            for kind, cfg, ms, err in time_candidates(f"{name} M={M}", cands, ws, ref):
                r = dict(shape=name, N=N, K=K, M=M, per_step=per_step, kind=kind, cfg=cfg, ms=ms,
                         pct=100 * nbytes / (ms * 1e-3) / 1e9 / bw, err=err)
                res.append(r)
                print(f"  {name} M={M} {kind:6s} {str(cfg):70s} {ms * 1e3:8.1f} us "
                      f"{r['pct']:5.1f}% err {err:.1e}", flush=True)
        del ws
        torch.cuda.empty_cache()
    lines = [head, "", "| shape | N x K | M | cuBLAS us (% copy) | rule us (% copy) | best Triton us (% copy) | config |",
             "|---|---|---|---|---|---|---|"]
    tot = {}
    for name, N, K, per_step in shapes:
        for M in args.m:
            rows = [r for r in res if r["shape"] == name and r["M"] == M]
            cb = [r for r in rows if r["kind"] == "cublas"]
            rule = [r for r in rows if r["kind"] == "rule"]
            tr = sorted([r for r in rows if r["kind"] not in ("cublas", "rule")], key=lambda r: r["ms"])
            if not cb or not tr or not rule:
                continue
            c, t, u = cb[0], tr[0], rule[0]
            lines.append(f"| {name} | {N} x {K} | {M} | {c['ms'] * 1e3:.1f} ({c['pct']:.0f}%) | "
                         f"{u['ms'] * 1e3:.1f} ({u['pct']:.0f}%) | "
                         f"{t['ms'] * 1e3:.1f} ({t['pct']:.0f}%) | {t['kind']} {t['cfg']} |")
            tp = name.split("(TP=")[1].rstrip(")") if "(TP=" in name else "1"
            a = tot.setdefault((tp, M), [0.0, 0.0, 0.0])
            a[0] += per_step * c["ms"]
            a[1] += per_step * u["ms"]
            a[2] += per_step * min(c["ms"], t["ms"])
    for (tp, M), (c, u, b) in tot.items():
        lines.append(f"\nTP={tp} M={M}: projections of one {args.model} decode step (one rank): cuBLAS {c:.3f} ms, "
                     f"rule {u:.3f} ms, best-of per shape {b:.3f} ms (rule / best {u / b:.3f}x)")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(dict(head=head, rows=res), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
