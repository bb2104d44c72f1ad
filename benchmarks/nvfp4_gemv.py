"""NVFP4 decode projections on the Nemotron-H-8B shapes (CUDA): the dispatch rule
(``nvfp4_skinny_linear``) and a config sweep of the three kernels (the FMA kernel at one row, the
rows kernel at 2-8 rows, the dot kernel in both operand orders and with K in slices at more rows;
the persistent one-row kernel up to K 8192, and with K in slices above) beside the bf16 skinny
kernel (cuBLAS above 8 rows) on the same shapes. Timing: ``benchmarks.common.graph_ms`` over weight
copies beyond L2. Prints per shape and the totals weighted by calls per 8B decode step (lm_head
included).

    python benchmarks/nvfp4_gemv.py [--m 1 2 4 8 32]
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hybrid_engine.quantization.nvfp4_fma_kernels as FK  # noqa: E402
import hybrid_engine.quantization.nvfp4_kernels as NK  # noqa: E402
from benchmarks.common import graph_ms, sweep_header  # noqa: E402
from hybrid_engine.models.skinny_linear import skinny_linear  # noqa: E402
from hybrid_engine.quantization.nvfp4 import nvfp4_linear_ref, quantize_nvfp4  # noqa: E402

SHAPES = [("mamba in_proj", 18560, 4096, 24), ("mamba out_proj", 4096, 8192, 24), ("mlp up_proj", 21504, 4096, 24),
          ("mlp down_proj", 4096, 21504, 24), ("attn q/o_proj", 4096, 4096, 8), ("attn k/v_proj", 1024, 4096, 8),
          ("lm_head", 131072, 4096, 1)]
FMA_CFGS = [(4, 256, 4), (8, 128, 4), (8, 256, 4), (8, 256, 8), (4, 128, 4), (8, 64, 4)]
# the persistent one-row kernel (K <= 8192): (block_n, programs per SM, warps, pipeline)
PERSISTENT_CFGS = [(bn, pps, nw, pl) for bn in (2, 4) for pps in (4, 8) for nw in (4, 8) for pl in (False, True)]
# above K 8192 (down_proj): K in slices, (block_n, programs per SM, warps, pipeline, k_slices)
SLICED_CFGS = [(bn, pps, nw, pl, ks) for bn in (2, 4) for pps in (4, 8) for nw in (4, 8) for pl in (False, True)
               for ks in (3, 6, 21)]
# the rows kernel (2-8 rows): (block_n, block_g, warps)
ROWS_CFGS = [(4, 256, 4), (8, 128, 4), (8, 64, 4), (16, 64, 4)]
# (block_n, block_w, swap, num_stages, k_slices)
DOT_CFGS = [(32, 32, False, 3, 1), (32, 64, False, 3, 1), (16, 64, False, 3, 1), (64, 16, True, 4, 1),
            (64, 32, True, 3, 1), (128, 16, True, 3, 1), (64, 16, True, 4, 3), (64, 16, True, 4, 4),
            (64, 16, True, 4, 6), (64, 16, True, 4, 8)]


def candidates(M, N, K):
    if M == 1:
        return [(f"fma {c}", functools.partial(FK.nvfp4_skinny_linear_fma, block_n=c[0], block_g=c[1], num_warps=c[2]))
                for c in FMA_CFGS] + [
            (f"persist {c}", functools.partial(FK.nvfp4_skinny_linear_fma, block_n=c[0], block_g=None,
                                               programs_per_sm=c[1], num_warps=c[2], pipeline=c[3]))
            for c in PERSISTENT_CFGS if K <= 16 * FK.MAX_PERSISTENT_GROUPS] + [
            (f"persist-k{c[4]} {c[:4]}", functools.partial(FK.nvfp4_skinny_linear_fma, block_n=c[0], block_g=None,
                                                           programs_per_sm=c[1], num_warps=c[2], pipeline=c[3],
                                                           k_slices=c[4]))
            for c in SLICED_CFGS if K > 16 * FK.MAX_PERSISTENT_GROUPS and -(-K // (16 * c[4])) <= FK.MAX_PERSISTENT_GROUPS]
    rows = [(f"rows {c}", functools.partial(FK.nvfp4_skinny_linear_rows, block_n=c[0], block_g=c[1], num_warps=c[2]))
            for c in ROWS_CFGS] if M <= FK.MAX_FMA_ROWS else []
    # above 32 rows (64-row x tiles) x on the MMA's M side does not compile at these output tiles
    return rows + [(f"{'swap' if c[2] else 'dot'} {c[:2]}+{c[3]} k{c[4]}",
                    functools.partial(NK.nvfp4_skinny_linear_dot, block_n=c[0], block_w=c[1], swap=c[2],
                                      num_stages=c[3], k_slices=c[4]))
                   for c in DOT_CFGS if (c[2] or M <= 32) and (c[4] == 1 or N < 65536)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    sweep_header()
    rows: dict[int, list[tuple[int, dict]]] = {M: [] for M in args.m}      # per M: (calls a step, times)
    for name, N, K, per in SHAPES:
        w = torch.randn(N, K, device="cuda") * 0.02
        p, bs, gs = quantize_nvfp4(w)
        nb = p.numel() + bs.numel() + 4
        ws = [(p.clone(), bs.clone(), gs.clone()) for _ in range(max(1, min(8, -(-(200 << 20) // nb))))]
        wb = [w.to(torch.bfloat16).clone() for _ in range(max(1, min(8, -(-(200 << 20) // (N * K * 2)))))]
        del w
        for M in args.m:
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            ref = nvfp4_linear_ref(x.float(), *ws[0]).float()            # the exact float32 twin
            bf16 = skinny_linear if M <= 8 else F.linear
            row = {"bf16": graph_ms([lambda b=b: bf16(x, b) for b in wb]),
                   "rule": graph_ms([lambda t=t: NK.nvfp4_skinny_linear(x, *t) for t in ws])}
            for label, f in candidates(M, N, K):
                err = float((f(x, *ws[0]).float() - ref).abs().max() / ref.abs().max())
                if err > 1e-2:
                    print(f"  error {name} M={M} {label}: {err:.2e}", flush=True)
                row[label] = graph_ms([lambda t=t, f=f: f(x, *t) for t in ws])
            best = min((k for k in row if k not in ("bf16", "rule")), key=row.get)
            print(f"{name:15s} M={M:3d} bf16 {row['bf16'] * 1e3:7.1f} us | rule {row['rule'] * 1e3:7.1f} "
                  f"({nb / row['rule'] / 1e6:.0f} GB/s) | best {best} {row[best] * 1e3:.1f} | "
                  + " ".join(f"{k}:{v * 1e3:.1f}" for k, v in row.items() if k not in ("bf16", "rule")), flush=True)
            rows[M].append((per, row))
        del ws, wb
        torch.cuda.empty_cache()
    for M in args.m:
        # a config that does not run some shape (the persistent kernel above K 8192) counts the rule's
        # time there (marked *), so that every total is a whole step
        labels = {k for _, row in rows[M] for k in row}
        tot = {k: sum(per * row.get(k, row["rule"]) for per, row in rows[M]) for k in labels}
        part = {k for k in labels if any(k not in row for _, row in rows[M])}
        b = tot["bf16"]
        print(f"8B step totals, {M} row(s), ms (* = the rule where the config does not apply): " + ", ".join(
            f"{k}{'*' if k in part else ''}: {v:.3f} (x{b / v:.2f} bf16)" for k, v in sorted(tot.items(), key=lambda kv: kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
