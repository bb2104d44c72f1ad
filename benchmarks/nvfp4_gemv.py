"""NVFP4 decode projections at one row (M = 1) on the Nemotron-H-8B shapes: the dot kernel, the
one-row dispatch ("rule": the FMA kernel at its configs) and the FMA kernel over a few configs,
beside the bf16 skinny kernel on the same shapes (CUDA). Timing: ``benchmarks.common.graph_ms`` over weight copies beyond L2. Prints per
shape and the totals weighted by calls per 8B decode step.

    python benchmarks/nvfp4_gemv.py
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hybrid_engine.quantization.nvfp4_kernels as NK  # noqa: E402
from benchmarks.common import copy_bandwidth, graph_ms  # noqa: E402
from hybrid_engine.models.skinny_linear import skinny_linear  # noqa: E402
from hybrid_engine.quantization.nvfp4 import nvfp4_linear_ref, quantize_nvfp4  # noqa: E402
from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear_fma  # noqa: E402

SHAPES = [("mamba in_proj", 18560, 4096, 24), ("mamba out_proj", 4096, 8192, 24), ("mlp up_proj", 21504, 4096, 24),
          ("mlp down_proj", 4096, 21504, 24), ("attn q/o_proj", 4096, 4096, 8), ("attn k/v_proj", 1024, 4096, 8),
          ("lm_head", 131072, 4096, 1)]
CFGS = [(8, 32, 4), (4, 64, 8), (4, 32, 4), (8, 64, 8), (4, 128, 8), (2, 64, 4), (8, 16, 4), (16, 32, 8),
        (2, 128, 8)]
bw = copy_bandwidth() / 1e9
print(torch.cuda.get_device_name(), "copy GB/s", round(bw), flush=True)
tot = {}
for name, N, K, per in SHAPES:
    w = torch.randn(N, K, device="cuda") * 0.02
    p, bs, gs = quantize_nvfp4(w)
    nb = p.numel() + bs.numel() + 4
    ncopy = max(1, min(8, -(-(200 << 20) // nb)))
    ws = [(p.clone(), bs.clone(), gs.clone()) for _ in range(ncopy)]
    wb = [w.to(torch.bfloat16).clone() for _ in range(max(1, min(8, -(-(200 << 20) // (N * K * 2)))))]
    del w
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    dotf = functools.partial(NK.nvfp4_skinny_linear, block_n=64 if N >= 20000 else 16)   # block_n given: the dot kernel
    ref = nvfp4_linear_ref(x.float(), *ws[0])                     # the exact float32 twin
    row = {}
    row["bf16"] = graph_ms([lambda b=b: skinny_linear(x, b) for b in wb])
    row["dot"] = graph_ms([lambda t=t: dotf(x, *t) for t in ws])
    row["rule"] = graph_ms([lambda t=t: NK.nvfp4_skinny_linear(x, *t) for t in ws])     # the one-row dispatch
    for c in CFGS:
        f = functools.partial(nvfp4_skinny_linear_fma, block_n=c[0], block_g=c[1], num_warps=c[2])
        y = f(x, *ws[0])
        err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
        row[c] = graph_ms([lambda t=t: f(x, *t) for t in ws])
        if err > 1e-2:
            print("  err", name, c, err)
    best = min(CFGS, key=lambda c: row[c])
    print(f"{name:15s} bf16 {row['bf16']*1e3:7.1f} us | nvfp4 dot {row['dot']*1e3:7.1f} | rule {row['rule']*1e3:7.1f} | "
          f"fma best {best} {row[best]*1e3:7.1f} "
          f"({nb / row[best] / 1e6:.0f} GB/s) | " + " ".join(f"{c}:{row[c]*1e3:.1f}" for c in CFGS), flush=True)
    for k, v in row.items():
        tot[k] = tot.get(k, 0) + per * v
    del ws, wb
    torch.cuda.empty_cache()
print("8B step totals ms: " + ", ".join(f"{k}: {v:.3f}" for k, v in tot.items()))
