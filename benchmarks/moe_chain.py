"""One MoE layer's decode path on the Nano-30B-A3B widths, timed as a chain of layers with distinct
weights (together beyond L2, so the weights stream from HBM as in a real step) inside one CUDA
graph: router logits, routing and routed experts with the shared expert beside them on a side
stream, joined at the combine (``moe_ops.start_beside``; CUDA); ``--serial`` also times one stream.

    python benchmarks/moe_chain.py --tokens 1 4 8 [--router-tiles 4,256,8 1,2048,4] [--shared-tiles 8,512,4]
                                   [--expert-tiles up:16,512,4 down:8,512,4] [--fp8 | --nvfp4]
                                   [--profile] [--serial] --out DIR

Per token count: microseconds per layer and the layer's bytes over that time (at one token: six
experts, the shared expert and the float32 router); with --router-tiles, the layer and a
router-only chain under each (BLOCK_N, BLOCK_K, warps) of the router GEMV; with --shared-tiles,
the layer under each tile of the shared expert's two GEMVs (bf16 ``rowwise``: they run beside the
router and the routed experts, so a tile that is best alone need not be best here); with --expert-tiles, the layer under
each tile of the routed experts' up or down GEMV; with --fp8, the layers as ``quantization="fp8"``
builds them (routed experts FP8 with a scale per expert, the shared expert's two projections FP8
with per-channel scales through ``fp8_linear``; the float32 router stays); with --nvfp4, as
``quantization="nvfp4"`` builds them (routed experts NVFP4, decoded in the fused MoE kernels,
``quantization/nvfp4_experts.py``; the shared expert through ``nvfp4_linear``), and --expert-tiles
then gives the NVFP4 decode kernel's BLOCK_N,BLOCK_G (16-input groups),warps for both projections
(NVFP4 experts take one tile). Under any candidate
tiles the default is timed again last, so the run's own drift shows. With --profile, each
kernel's time in a layer at one token with programmatic dependent launch off (with it on, the
profiler counts a kernel from its early launch). HYBRID_ENGINE_PDL=0 runs the whole thing without
PDL. Writes moe-chain.json to --out.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import graph_ms, save_json  # noqa: E402
from hybrid_engine.mamba_cache.ops import triton_pdl  # noqa: E402
from hybrid_engine.models import triton_moe  # noqa: E402
from hybrid_engine.models.moe_ops import RouteSpec, route, router_logits, start_beside  # noqa: E402

from benchmarks.moe import SHAPE_NANO  # noqa: E402

D, F, F_SHARED = (SHAPE_NANO[k] for k in ("hidden_size", "moe_intermediate_size",
                                          "moe_shared_expert_intermediate_size"))
E, TOP_K = SHAPE_NANO["n_routed_experts"], SHAPE_NANO["num_experts_per_tok"]


def make_layers(n: int, dev, fp8: bool = False, nvfp4: bool = False) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)
    def w(*shape, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=g, device=dev) * 0.02).to(dtype)
    layers = [dict(gate=w(E, D, dtype=torch.float32), bias=torch.zeros(E, device=dev), up=w(E, F, D),
                   down=w(E, D, F), s_up=w(F_SHARED, D), s_down=w(D, F_SHARED)) for _ in range(n)]
    return [fp8_layer(ly) for ly in layers] if fp8 else [nvfp4_layer(ly) for ly in layers] if nvfp4 else layers


def fp8_layer(ly: dict) -> dict:
    """``ly`` as ``quantization="fp8"`` stores it: routed experts with one scale per expert and
    projection (``Fp8Experts.quantized_from``), the shared expert's projections per channel."""
    from types import SimpleNamespace

    from hybrid_engine.quantization.experts import Fp8Experts
    from hybrid_engine.quantization.fp8 import quantize_fp8
    experts = Fp8Experts.quantized_from(SimpleNamespace(up_proj=ly["up"], down_proj=ly["down"]))
    out = dict(gate=ly["gate"], bias=ly["bias"], up=experts.up_proj.data, down=experts.down_proj.data,
               up_scale=experts.up_proj_weight_scale.data, down_scale=experts.down_proj_weight_scale.data)
    for name in ("s_up", "s_down"):
        out[name], out[name + "_scale"] = quantize_fp8(ly[name], per_channel=True)
    return out


def nvfp4_layer(ly: dict) -> dict:
    """``ly`` as ``quantization="nvfp4"`` stores it: routed experts per expert
    (``Nvfp4Experts.quantized_from``), the shared expert's projections as ``Nvfp4Linear``."""
    from types import SimpleNamespace

    from hybrid_engine.quantization.experts import Nvfp4Experts
    from hybrid_engine.quantization.nvfp4 import quantize_nvfp4
    ex = Nvfp4Experts.quantized_from(SimpleNamespace(up_proj=ly["up"], down_proj=ly["down"]))
    out = dict(gate=ly["gate"], bias=ly["bias"], up=ex.up_proj.data, down=ex.down_proj.data,
               up_scale=ex.up_proj_weight_scale_2.data, down_scale=ex.down_proj_weight_scale_2.data,
               up_blocks=ex.up_proj_weight_scale.data, down_blocks=ex.down_proj_weight_scale.data)
    for name in ("s_up", "s_down"):
        out[name + "_nvfp4"] = quantize_nvfp4(ly[name])
    return out


def layer_fn(ly: dict, x: torch.Tensor, spec: RouteSpec, serial: bool = False):
    """One layer as the model runs it: the shared expert on a side stream beside the router, the
    routing and the routed experts, joined at their combine (``moe_ops.start_beside``); ``serial``:
    all on one stream, shared expert after the routing."""
    def shared():
        if "s_up_scale" in ly:           # FP8, as Fp8Linear runs it (relu² through forward_relu2)
            from hybrid_engine.quantization.fp8 import fp8_linear
            h = fp8_linear(x, ly["s_up"], ly["s_up_scale"])
            return fp8_linear(h, ly["s_down"], ly["s_down_scale"], relu2=True)
        if "s_up_nvfp4" in ly:         # NVFP4, as Nvfp4Linear runs it
            from hybrid_engine.quantization.nvfp4 import nvfp4_linear
            return nvfp4_linear(nvfp4_linear(x, *ly["s_up_nvfp4"]), *ly["s_down_nvfp4"], relu2=True)
        return triton_moe.rowwise_linear_triton(triton_moe.rowwise_linear_triton(x, ly["s_up"], relu2=True),
                                                ly["s_down"])

    def routing():
        return route(router_logits(x, ly["gate"]), ly["bias"], spec)

    def run():
        if serial:
            ids, wts = routing()
            s = shared()
        else:
            s = start_beside(shared, x.device)
            ids, wts = routing()
        if "up_blocks" in ly:
            from hybrid_engine.quantization.nvfp4_experts import routed_experts_nvfp4_triton
            routed_experts_nvfp4_triton(x, ly["up"], ly["up_blocks"], ly["up_scale"], ly["down"], ly["down_blocks"],
                                        ly["down_scale"], ids, wts, add=s)
        else:
            triton_moe.routed_experts_triton(x, ly["up"], ly["down"], ids, wts, add=s,
                                             up_scale=ly.get("up_scale"), down_scale=ly.get("down_scale"))
        if not serial:
            s.wait()
    return run


def tiles_rule(real, router=None, shared=None, up=None, down=None):
    """``triton_moe.gemv_tiles`` with some roles' tiles replaced: ``router`` for the float32 router
    weight, ``shared`` for the 16-bit shared-expert weights (``rowwise``), ``up`` / ``down`` for the
    routed experts' GEMVs (None: ``real``'s)."""
    def rule(role, tokens, weight):
        if role == "rowwise":
            tiles = router if weight.element_size() == 4 else shared
        else:
            tiles = up if role == "up" else down
        return tiles if tiles is not None else real(role, tokens, weight)
    return rule


def parse_expert_tiles(text: str) -> tuple[str, tuple[int, int, int]]:
    """"up:16,512,4" -> ("up", (16, 512, 4)); ValueError naming the accepted form otherwise."""
    role, _, tiles = text.partition(":")
    vals = tiles.split(",")
    if role not in ("up", "down") or len(vals) != 3 or not all(v.strip().isdigit() for v in vals):
        raise ValueError(f"--expert-tiles takes ROLE:BLOCK_N,BLOCK_K,WARPS with ROLE up or down, got {text!r}")
    return role, tuple(int(v) for v in vals)


def layer_bytes(tokens: int, weight_bytes: float = 2) -> int:
    """Bytes a layer reads (``weight_bytes`` per expert / shared-expert weight: 2 bf16, 1 FP8,
    0.5625 NVFP4 with its block scales)."""
    experts = min(tokens * TOP_K, E)                     # at most; exactly 6 at one token
    return int((experts * 2 * D * F + 2 * D * F_SHARED) * weight_bytes) + E * D * 4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--layers", type=int, default=8, help="distinct layers in the chain (8: 1.3 GB)")
    ap.add_argument("--router-tiles", nargs="*", default=[], help="BLOCK_N,BLOCK_K,warps candidates")
    ap.add_argument("--shared-tiles", nargs="*", default=[],
                    help="BLOCK_N,BLOCK_K,warps candidates for the shared expert's GEMVs")
    ap.add_argument("--expert-tiles", nargs="*", default=[],
                    help="ROLE:BLOCK_N,BLOCK_K,warps candidates for the routed experts' GEMVs (ROLE up or down)")
    quant = ap.add_mutually_exclusive_group()
    quant.add_argument("--fp8", action="store_true", help="FP8 routed and shared experts, as quantization='fp8'")
    quant.add_argument("--nvfp4", action="store_true", help="NVFP4 routed and shared experts, as quantization='nvfp4'")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--serial", action="store_true",
                    help="also time each layer on one stream (the shared expert after the routing, as before)")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    dev = torch.device("cuda")
    spec = RouteSpec(num_experts=E, top_k=TOP_K, n_group=SHAPE_NANO["n_group"], topk_group=SHAPE_NANO["topk_group"],
                     norm_topk_prob=SHAPE_NANO["norm_topk_prob"], scale=SHAPE_NANO["routed_scaling_factor"])
    expert_tiles = [parse_expert_tiles(t) for t in args.expert_tiles]     # before any GPU work
    layers = make_layers(args.layers, dev, fp8=args.fp8, nvfp4=args.nvfp4)
    wbytes = 1 if args.fp8 else 0.5625 if args.nvfp4 else 2
    pdl = triton_pdl.pdl_kwargs(dev)["PDL"]
    res = dict(device=torch.cuda.get_device_name(), pdl=pdl, fp8=args.fp8, nvfp4=args.nvfp4,
               command=" ".join(sys.argv), rows=[])
    print(f"{res['device']}, PDL {'on' if pdl else 'off'}, {args.layers} layers", flush=True)
    real_tiles = triton_moe.gemv_tiles
    from hybrid_engine.quantization import nvfp4_experts
    real_nvfp4_tiles = nvfp4_experts.DECODE_TILES
    for T in args.tokens:
        x = torch.randn(T, D, device=dev, dtype=torch.bfloat16) * 0.1
        calls = [layer_fn(ly, x, spec) for ly in layers]
        routers = [lambda ly=ly: router_logits(x, ly["gate"]) for ly in layers]
        parse = lambda t: tuple(int(v) for v in t.split(","))       # noqa: E731
        variants = ([dict()] + [dict(router=parse(t)) for t in args.router_tiles]
                    + [dict(shared=parse(t)) for t in args.shared_tiles]
                    + [{role: tiles} for role, tiles in expert_tiles])
        if len(variants) > 1:
            variants.append(dict())                     # the default again: the run's drift
        for v in variants:
            router_t, shared_t = v.get("router"), v.get("shared")
            expert_t = {k: v[k] for k in ("up", "down") if k in v}
            triton_moe.gemv_tiles = tiles_rule(real_tiles, router_t, shared_t, **expert_t)
            # NVFP4 experts take one tile for both projections: a candidate of either role sets it
            nvfp4_experts.DECODE_TILES = next(iter(expert_t.values()), real_nvfp4_tiles)
            try:
                for c in calls + routers:
                    c()
                us = graph_ms(calls, reps=len(calls)) * 1e3
                router_us = graph_ms(routers, reps=len(routers)) * 1e3
            finally:
                triton_moe.gemv_tiles = real_tiles
                nvfp4_experts.DECODE_TILES = real_nvfp4_tiles
            row = dict(tokens=T, router_tiles=router_t or "default", shared_tiles=shared_t or "default",
                       expert_tiles={k: list(t) for k, t in expert_t.items()} or "default",
                       serial=False, layer_us=us, router_us=router_us,
                       layer_GBps=layer_bytes(T, wbytes) / us / 1e3 if T == 1 else None)
            res["rows"].append(row)
            print(f"T={T} router tiles {row['router_tiles']}, shared tiles {row['shared_tiles']}, expert tiles "
                  f"{row['expert_tiles']}: {us:.1f} us "
                  f"per layer, router {router_us:.2f} us" + (f", {row['layer_GBps']:.0f} GB/s" if T == 1 else ""),
                  flush=True)
        if args.serial:
            serial = [layer_fn(ly, x, spec, serial=True) for ly in layers]
            for c in serial:
                c()
            us = graph_ms(serial, reps=len(serial)) * 1e3
            res["rows"].append(dict(tokens=T, router_tiles="default", serial=True, layer_us=us))
            print(f"T={T} one stream: {us:.1f} us per layer", flush=True)
    if args.profile:
        res["profile_us"] = profile_one_token(layers, spec, dev)
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / "moe-chain.json", res)
    return 0


def profile_one_token(layers, spec, dev) -> list:
    """[(kernel, us)] in launch order for one layer at one token, PDL off, mean over the chain; the
    layers run on one stream (``serial``): with the side stream the two streams' kernels start in
    no fixed order, and names would be matched to times by position."""
    from torch.profiler import ProfilerActivity, profile
    before = os.environ.get("HYBRID_ENGINE_PDL")
    os.environ["HYBRID_ENGINE_PDL"] = "0"
    triton_pdl.reset_pdl_choice()
    x = torch.randn(1, D, device=dev, dtype=torch.bfloat16) * 0.1
    calls = [layer_fn(ly, x, spec, serial=True) for ly in layers]
    for c in calls:
        c()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    torch.cuda.synchronize()
    reps = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if (getattr(e, "device_time", 0) or 0) > 0),
                 key=lambda e: e.time_range.start)
    per = len(evs) // (reps * len(layers))
    rows = [[evs[i].name[:40], 0.0] for i in range(per)]
    for i, e in enumerate(evs[:per * reps * len(layers)]):
        rows[i % per][1] += e.device_time / (reps * len(layers))
    for name, us in rows:
        print(f"  {name:40s} {us:6.2f} us", flush=True)
    if before is None:
        del os.environ["HYBRID_ENGINE_PDL"]
    else:
        os.environ["HYBRID_ENGINE_PDL"] = before
    triton_pdl.reset_pdl_choice()
    return rows


if __name__ == "__main__":
    sys.exit(main())
