"""The routed experts alone (one Nano-30B-A3B MoE layer's experts: 128 experts of D 2688 x F 1856,
top 6) in bf16, FP8 and NVFP4, per token count, each timed as a chain of layers with distinct
weights (beyond L2, as in a real step) inside one CUDA graph; the tokens' routing is random.

    python benchmarks/moe_experts_quant.py --tokens 1 4 8 64 256 2048 [--layers 4] [--decode-tiles 4,256,4 ...]
                                           [--nvfp4-paths gemv grouped] --out DIR

Per token count and format: microseconds per layer's experts, and at decode sizes (<= 8 tokens)
the bytes of the experts the tokens chose over that time (bf16 2 bytes a weight, FP8 1, NVFP4
0.5625 with its block scales); above 8 tokens the TFLOP/s over the chosen pairs (bf16 and FP8 run
their grouped GEMMs there, FP8 as W8A8; NVFP4 takes ``nvfp4_experts.nvfp4_path``'s choice: decode
GEMVs per pair up to ``GEMV_MAX_TOKENS``, the grouped GEMM on tiles decoded to bf16 above). Each row
says which path ran. ``--nvfp4-paths`` also times NVFP4 on each named path at every token count;
``--decode-tiles`` also times the decode kernel under each (BLOCK_N, BLOCK_G, warps) at <= 8
tokens, then the rule's again (the run's drift). Writes moe-experts-quant.json to --out.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import graph_ms, save_json  # noqa: E402
from benchmarks.moe import SHAPE_NANO  # noqa: E402

D, F = SHAPE_NANO["hidden_size"], SHAPE_NANO["moe_intermediate_size"]
E, TOP_K = SHAPE_NANO["n_routed_experts"], SHAPE_NANO["num_experts_per_tok"]
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5625}


def make_experts(n: int, dev) -> dict[str, list[dict]]:
    """{format: [layer's expert tensors]} for n layers, the quantized ones made from the bf16 ones
    as ``quantization="fp8"`` / ``"nvfp4"`` does (per expert)."""
    from hybrid_engine.quantization.experts import Fp8Experts, Nvfp4Experts
    g = torch.Generator(device=dev).manual_seed(0)
    out = {"bf16": [], "fp8": [], "nvfp4": []}
    for _ in range(n):
        up = (torch.randn(E, F, D, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        down = (torch.randn(E, D, F, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        src = SimpleNamespace(up_proj=up, down_proj=down)
        f8, f4 = Fp8Experts.quantized_from(src), Nvfp4Experts.quantized_from(src)
        out["bf16"].append(dict(up=up, down=down))
        out["fp8"].append(dict(up=f8.up_proj.data, down=f8.down_proj.data, up_scale=f8.up_proj_weight_scale.data,
                               down_scale=f8.down_proj_weight_scale.data))
        out["nvfp4"].append(dict(up=f4.up_proj.data, down=f4.down_proj.data,
                                 up_scale=f4.up_proj_weight_scale_2.data, down_scale=f4.down_proj_weight_scale_2.data,
                                 up_blocks=f4.up_proj_weight_scale.data, down_blocks=f4.down_proj_weight_scale.data))
    return out


def experts_call(ly: dict, x, ids, wts, nvfp4_path: str | None = None):
    """One layer's experts; ``nvfp4_path`` forces the NVFP4 path (``nvfp4_experts.NVFP4_PATHS``)."""
    from hybrid_engine.models.moe_ops import routed_experts
    if nvfp4_path is not None:
        from hybrid_engine.quantization.nvfp4_experts import routed_experts_nvfp4_triton
        return lambda: routed_experts_nvfp4_triton(x, ly["up"], ly["up_blocks"], ly["up_scale"], ly["down"],
                                                   ly["down_blocks"], ly["down_scale"], ids, wts, path=nvfp4_path)
    return lambda: routed_experts(x, ly["up"], ly["down"], ids, wts, up_scale=ly.get("up_scale"),
                                  down_scale=ly.get("down_scale"), up_blocks=ly.get("up_blocks"),
                                  down_blocks=ly.get("down_blocks"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 64, 256, 2048])
    ap.add_argument("--layers", type=int, default=4, help="distinct layers in the chain (4: 5.1 GB of bf16 experts)")
    ap.add_argument("--decode-tiles", nargs="*", default=[], help="BLOCK_N,BLOCK_G,warps candidates of the NVFP4 "
                                                                  "decode kernel")
    ap.add_argument("--nvfp4-paths", nargs="*", default=[], help="also time NVFP4 on these paths (gemv, grouped) "
                                                                 "at every token count")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.decode_tiles]
    if any(len(t) != 3 for t in tiles):
        raise ValueError(f"--decode-tiles takes BLOCK_N,BLOCK_G,WARPS, got {args.decode_tiles}")
    from hybrid_engine.quantization import nvfp4_experts as nx
    bad = set(args.nvfp4_paths) - set(nx.NVFP4_PATHS)
    if bad:
        raise ValueError(f"--nvfp4-paths takes {nx.NVFP4_PATHS}, got {sorted(bad)}")
    dev = torch.device("cuda")
    layers = make_experts(args.layers, dev)
    res = dict(device=torch.cuda.get_device_name(), command=" ".join(sys.argv), experts=E, top_k=TOP_K, D=D, F=F,
               rows=[])
    print(f"{res['device']}, {args.layers} layers of {E} experts ({D} x {F}), top {TOP_K}", flush=True)
    g = torch.Generator(device=dev).manual_seed(1)
    rule_tiles = nx.DECODE_TILES
    for T in args.tokens:
        x = torch.randn(T, D, generator=g, device=dev).to(torch.bfloat16)
        ids = torch.argsort(torch.rand(T, E, generator=g, device=dev), dim=1)[:, :TOP_K].to(torch.int32)
        wts = torch.rand(T, TOP_K, generator=g, device=dev)
        chosen = int(torch.unique(ids).numel())            # distinct experts (setup, not timed)
        # (format, NVFP4 path or None for the rule, decode tiles or None for the rule's)
        variants = [(fmt, None, None) for fmt in ("bf16", "fp8", "nvfp4")]
        variants += [("nvfp4", p, None) for p in args.nvfp4_paths]
        if T <= 8 and tiles:
            variants += [("nvfp4", "gemv", t) for t in tiles] + [("nvfp4", None, None)]     # the rule again: drift
        for fmt, path, t in variants:
            nx.DECODE_TILES = t or rule_tiles
            try:
                calls = [experts_call(ly, x, ids, wts, path) for ly in layers[fmt]]
                for c in calls:
                    c()
                us = graph_ms(calls, reps=len(calls)) * 1e3
            finally:
                nx.DECODE_TILES = rule_tiles
            ran = (path or nx.nvfp4_path(T)) if fmt == "nvfp4" else "gemv" if T <= 8 else "grouped"
            row = dict(tokens=T, format=fmt, path=ran, rule=path is None,
                       tiles=list(t) if t else "rule", us=us, distinct_experts=chosen)
            if T <= 8:
                row["GBps"] = chosen * 2 * D * F * BYTES_PER_WEIGHT[fmt] / us / 1e3
            else:
                row["TFLOPs"] = T * TOP_K * 2 * 2 * D * F / us / 1e6
            res["rows"].append(row)
            rate = f"{row['GBps']:.0f} GB/s" if T <= 8 else f"{row['TFLOPs']:.0f} TFLOP/s"
            print(f"T={T} {fmt:5s} {ran:7s}{' (rule)' if path is None else '       '} tiles {row['tiles']}: "
                  f"{us:.1f} us per layer, {rate}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / "moe-experts-quant.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
