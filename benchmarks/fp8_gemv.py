"""FP8 weights on the Nemotron-H-8B projection shapes (CUDA), two parts:

- decode (``--m``, 1..8 token rows): the Triton FP8 kernels of ``quantization/fp8_kernels`` over a
  config sweep (the one-row FMA kernel, the dot kernel, with K in slices too), the "rule" row (what ``fp8_skinny_linear`` dispatches today) and the bf16 rule
  (``skinny_linear`` on bf16 weights) as the baseline; % of the measured copy bandwidth counts the
  weight + x + y bytes once. Timing: ``graph_ms`` over weight copies beyond L2.
- prefill (``--prefill``, token counts): bf16 ``F.linear`` against the W8A8 path
  (``torch._scaled_mm``) with the activations quantized by the torch ops (before) and by the one-pass
  Triton kernel (``quantize_rows_fp8``), per-channel weight scales and per-token activation scales.

Totals weight each shape by its calls per step. ``--model nano``: the Nemotron-3-Nano-30B-A3B
projections that ``fp8_skinny_linear`` runs under ``quantization="fp8"`` (Mamba, attention and the
shared expert; the lm_head stays 16-bit), with the one-row configs swept for them.

    python benchmarks/fp8_gemv.py [--model 8b|nano] [--m 1 2 4 8] [--prefill 2048 8192] [--json f.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import graph_ms, sweep_header, time_candidates  # noqa: E402
from benchmarks.gemv import NANO_SHAPES, SHAPES  # noqa: E402
from hybrid_engine.models.skinny_linear import skinny_linear  # noqa: E402
from hybrid_engine.quantization.fp8 import quantize_activations, quantize_fp8  # noqa: E402
from hybrid_engine.quantization.fp8_kernels import (fp8_skinny_linear, fp8_skinny_linear_dot,  # noqa: E402
                                                    fp8_skinny_linear_fma)
from hybrid_engine.quantization.fp8_quantizer import quantize_rows_fp8  # noqa: E402

FMA_CFGS = [dict(block_n=bn, block_k=bk, num_warps=nw)
            for bn, bk, nw in ((2, 1024, 4), (4, 1024, 4), (8, 1024, 8), (1, 2048, 4), (2, 2048, 4),
                               (4, 2048, 4), (4, 2048, 8), (8, 2048, 8), (2, 4096, 8), (4, 512, 4), (1, 4096, 4))]
# the Nano sweep (hidden 2688: K tiles of 2048 leave a third of their lanes masked;
# benchmarks/results/2026-11-27-fp8-gemv-nano-h100.md)
NANO_FMA_CFGS = [dict(block_n=bn, block_k=bk, num_warps=nw)
                 for bn, bk, nw in ((2, 2048, 4), (8, 2048, 8), (2, 1024, 4), (4, 1024, 4), (8, 1024, 8),
                                    (2, 512, 4), (4, 512, 4), (8, 512, 4), (8, 512, 8), (16, 512, 8),
                                    (4, 256, 4), (8, 256, 4), (16, 256, 4), (16, 128, 4), (8, 128, 4))]
FP8_NANO_SHAPES = ([s for s in NANO_SHAPES if s[0] != "lm_head"]
                   + [("shared up", 3712, 2688, 23), ("shared down", 2688, 3712, 23)])
DOT_CFGS = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=st)
            for bn, bk, nw, st in ((16, 512, 4, 3), (16, 1024, 4, 3), (32, 512, 4, 3), (32, 256, 4, 4),
                                   (64, 256, 4, 4), (16, 256, 4, 4), (32, 1024, 4, 2), (64, 512, 4, 3))] + [
    # K in slices (more programs for the narrow long-row projections, as the NVFP4 dot kernel's)
    dict(block_n=bn, block_k=512, num_warps=4, num_stages=3, k_slices=ks) for bn in (32, 64) for ks in (2, 3, 4, 6, 8)]


def _copies(nbytes: int) -> int:
    return max(1, min(8, -(-(200 << 20) // nbytes)))          # working set beyond L2


def decode(ms_list, bw, res, shapes=SHAPES, fma_cfgs=FMA_CFGS):
    for name, N, K, per_step in shapes:
        w = torch.randn(N, K, device="cuda") * 0.02
        q, s = quantize_fp8(w, per_channel=True)
        ws = [(q.clone(), s.clone()) for _ in range(_copies(N * K))]
        wb = [w.to(torch.bfloat16) for _ in range(_copies(2 * N * K))]
        del w
        for M in ms_list:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = F.linear(x.float(), q.float() * s[:, None])
            cands = [("rule", {}, lambda a, x=x: fp8_skinny_linear(x, *a))]
            cands += [("dot", c, lambda a, x=x, c=c: fp8_skinny_linear_dot(x, *a, **c)) for c in DOT_CFGS]
            if M == 1:
                cands += [("fma", c, lambda a, x=x, c=c: fp8_skinny_linear_fma(x, *a, **c)) for c in fma_cfgs]
            for kind, cfg, ms, err in time_candidates(f"{name} M={M}", cands, ws, ref):
                nbytes = N * K + 4 * N + (M * K + M * N) * 2
                res.append(dict(part="decode", shape=name, N=N, K=K, M=M, per_step=per_step, kind=kind, cfg=cfg,
                                ms=ms, pct=100 * nbytes / (ms * 1e-3) / 1e9 / bw, err=err))
                print(f"  {name} M={M} {kind:8s} {str(cfg):62s} {ms * 1e3:8.1f} us {res[-1]['pct']:5.1f}% "
                      f"err {err:.1e}", flush=True)
            calls = [lambda w=w, x=x: skinny_linear(x, w) for w in wb]
            for c in calls:
                c()
            ms = graph_ms(calls)
            res.append(dict(part="decode", shape=name, N=N, K=K, M=M, per_step=per_step, kind="bf16 rule", cfg={},
                            ms=ms, pct=100 * (2 * N * K + (M * K + M * N) * 2) / (ms * 1e-3) / 1e9 / bw, err=0.0))
            print(f"  {name} M={M} bf16 rule {ms * 1e3:8.1f} us {res[-1]['pct']:5.1f}%", flush=True)
        del ws, wb
        torch.cuda.empty_cache()


def _scaled_mm(x, q, s, quant):
    x_q, xs = quant(x)
    return torch._scaled_mm(x_q, q.t(), scale_a=xs, scale_b=s.reshape(1, -1), out_dtype=x.dtype)


def prefill(tokens_list, res, shapes=SHAPES):
    for name, N, K, per_step in shapes:
        if name == "lm_head":            # prefill takes the logits of the last tokens only
            continue
        w = torch.randn(N, K, device="cuda") * 0.02
        q, s = quantize_fp8(w, per_channel=True)
        wb = w.to(torch.bfloat16)
        del w
        for T in tokens_list:
            x = torch.randn(T, K, device="cuda").to(torch.bfloat16)
            cands = {"bf16": lambda: F.linear(x, wb),
                     "fp8 torch quant": lambda: _scaled_mm(x, q, s, lambda t: quantize_activations(t, None)),
                     "fp8 triton quant": lambda: _scaled_mm(x, q, s, quantize_rows_fp8),
                     "quant only (triton)": lambda: quantize_rows_fp8(x)}
            row = {}
            for kind, fn in cands.items():
                fn()
                row[kind] = graph_ms([fn], reps=5, replays=5)
                res.append(dict(part="prefill", shape=name, N=N, K=K, T=T, per_step=per_step, kind=kind,
                                ms=row[kind]))
            print(f"  {name} T={T} " + " ".join(f"{k} {v:.3f} ms" for k, v in row.items()), flush=True)
            del x
        del q, s, wb
        torch.cuda.empty_cache()


def summary(res, head, shapes=SHAPES, model="8B") -> str:
    lines = [head, "", f"## Decode (one {model} step's projections, weighted by calls per step)", "",
             "| M | bf16 rule ms | fp8 rule ms | fp8 best per shape ms | fp8 rule / bf16 | best / bf16 |",
             "|---|---|---|---|---|---|"]
    for M in sorted({r["M"] for r in res if r["part"] == "decode"}):
        tot = {"bf16": 0.0, "rule": 0.0, "best": 0.0}
        for name, N, K, per_step in shapes:
            rows = [r for r in res if r["part"] == "decode" and r["shape"] == name and r["M"] == M]
            by = {k: [r for r in rows if r["kind"] == k] for k in ("bf16 rule", "rule")}
            fp8 = sorted([r for r in rows if r["kind"] not in ("bf16 rule",)], key=lambda r: r["ms"])
            if not by["bf16 rule"] or not by["rule"] or not fp8:
                continue
            tot["bf16"] += per_step * by["bf16 rule"][0]["ms"]
            tot["rule"] += per_step * by["rule"][0]["ms"]
            tot["best"] += per_step * fp8[0]["ms"]
            lines_best = f"{name} M={M}: best {fp8[0]['kind']} {fp8[0]['cfg']} {fp8[0]['ms'] * 1e3:.1f} us " \
                         f"({fp8[0]['pct']:.0f}%), rule {by['rule'][0]['ms'] * 1e3:.1f} us ({by['rule'][0]['pct']:.0f}%)"
            print(lines_best)
        if tot["bf16"]:
            lines.append(f"| {M} | {tot['bf16']:.3f} | {tot['rule']:.3f} | {tot['best']:.3f} | "
                         f"{tot['bf16'] / tot['rule']:.2f}x | {tot['bf16'] / tot['best']:.2f}x |")
    pre = [r for r in res if r["part"] == "prefill"]
    if pre:
        lines += ["", f"## Prefill (one {model} step's projections)", "",
                  "| tokens | bf16 ms | fp8 torch quant ms | fp8 triton quant ms | quant only ms | fp8 (triton) vs bf16 |",
                  "|---|---|---|---|---|---|"]
        for T in sorted({r["T"] for r in pre}):
            tot = {}
            for r in pre:
                if r["T"] == T:
                    tot[r["kind"]] = tot.get(r["kind"], 0.0) + r["per_step"] * r["ms"]
            lines.append(f"| {T} | {tot['bf16']:.2f} | {tot['fp8 torch quant']:.2f} | {tot['fp8 triton quant']:.2f} | "
                         f"{tot['quant only (triton)']:.2f} | {tot['bf16'] / tot['fp8 triton quant']:.2f}x |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="*", default=[1, 2, 4, 8])
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--model", choices=["8b", "nano"], default="8b")
    args = ap.parse_args()
    shapes, fma_cfgs = (SHAPES, FMA_CFGS) if args.model == "8b" else (FP8_NANO_SHAPES, NANO_FMA_CFGS)
    head, bw = sweep_header()
    res = []
    if args.m:
        decode(args.m, bw, res, shapes, fma_cfgs)
    if args.prefill:
        prefill(args.prefill, res, shapes)
    text = summary(res, head, shapes, "8B" if args.model == "8b" else "Nano-30B-A3B")
    print(text, flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(head=head, rows=res), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
