"""Tile sweep of the MoE prefill path (``triton_moe._grouped_gemm_kernel``, up and down) on the
Nemotron-3-Nano-30B-A3B widths: the whole routed-experts call (alignment, up GEMM with relu², down
GEMM, combine with the routing weights) at prefill token counts, for each rows-per-tile
(``BLOCK_M``, normally ``align_block_size``'s pick) and GEMM tile config. Reported as TFLOP/s of
the selected experts' FLOPs (4 * pairs * D * F) and as a share of the bf16 matmul peak measured in
the same run; the table ends with the best config per T beside the one ``triton_moe`` picks today.

    python benchmarks/moe_gemm_sweep.py --out $OUT          # H100, a few minutes (compiles)

``--weights fp8`` runs FP8 experts (per-expert scales) weight-only (the FP8 tiles converted to
bf16 in the kernel), ``--weights w8a8`` FP8 experts with the rows quantized per token and FP8 dots
(what the engine runs for FP8 experts above 8 tokens); ``--modes`` times several weight modes at
today's picks only, as rows of one table, before any sweep.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine.models import moe_align, moe_ops, triton_moe  # noqa: E402
from hybrid_engine.quantization.fp8 import quantize_fp8  # noqa: E402

D, F, E, K_TOP = 2688, 1856, 128, 6     # hidden, expert inner, experts, top-k


def matmul_peak(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (time.perf_counter() - t)


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        fn()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) / 1e3)
    return statistics.median(times)


WEIGHT_MODES = ("bf16", "fp8", "w8a8")


def _fp8_per_expert(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (float8_e4m3fn codes, [E] float32 scales), one per-tensor quantization an
    expert, as ``Fp8Experts.quantized_from`` stores them."""
    qs = [quantize_fp8(w_e, per_channel=False) for w_e in w]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def inputs(T: int, weights_mode: str = "bf16"):
    g = torch.Generator(device="cuda").manual_seed(T)
    h = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w_up = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(E, D, F, device="cuda", generator=g) / F ** 0.5).to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(K_TOP, dim=1).indices.to(torch.int32)
    weights = torch.rand(T, K_TOP, device="cuda", generator=g)
    quant = {}
    if weights_mode != "bf16":
        (w_up, su), (w_down, sd) = _fp8_per_expert(w_up), _fp8_per_expert(w_down)
        quant = dict(up_scale=su, down_scale=sd, w8a8=weights_mode == "w8a8")
    return h, w_up, w_down, ids, weights, quant


def run_case(T, bm, cfg, iters, data):
    h, w_up, w_down, ids, weights, quant = data
    old_bm, old_cfg = triton_moe.align_block_size, triton_moe.gemm_config
    triton_moe.align_block_size = lambda P, E_, w8a8=False: bm
    triton_moe.gemm_config = (lambda bm_, dtype, swiglu=False, **kw: dict(cfg)) if cfg is not None else old_cfg
    out = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    try:
        fn = lambda: triton_moe.routed_experts_triton(h, w_up, w_down, ids, weights, force_grouped=True,  # noqa: E731
                                                      out=out, **quant)
        sec = timed(fn, iters)
        wu = moe_ops.dequantize_experts(w_up, quant.get("up_scale"), torch.bfloat16)
        wd = moe_ops.dequantize_experts(w_down, quant.get("down_scale"), torch.bfloat16)
        ref = moe_ops.grouped_experts_ref(h[:64], wu, wd, ids[:64].long(), weights[:64])
        err = (out[:64].float() - ref.float()).abs().max().item() / max(1e-6, ref.float().abs().max().item())
        if err > 0.05:
            raise AssertionError(f"wrong result (relative error {err:.3g})")
        return sec
    finally:
        triton_moe.align_block_size, triton_moe.gemm_config = old_bm, old_cfg


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--weights", choices=WEIGHT_MODES, default="bf16", help="the swept weights (module docstring)")
    ap.add_argument("--modes", choices=WEIGHT_MODES, nargs="*", default=[],
                    help="first time these weight modes at today's picks (one table, same run)")
    ap.add_argument("--no-sweep", action="store_true", help="only the --modes table")
    ap.add_argument("--block-k", type=int, nargs="+", default=None,
                    help="BLOCK_K values swept (default 32 64 128; 64 128 256 for FP8 weights)")
    ap.add_argument("--promote-k", type=int, nargs="+", default=[0],
                    help="w8a8: PROMOTE_K values swept (0: each config's BLOCK_K)")
    ap.add_argument("--block-n", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    peak = matmul_peak()
    lines = [f"# MoE prefill grouped-GEMM tile sweep ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, {time.strftime('%Y-%m-%d')})", "",
             f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s (8192^3, same run); D={D} F={F} E={E} k={K_TOP}; "
             f"swept weights: {args.weights}", ""]
    if args.modes:
        lines += ["## Weight modes at today's picks (ms per routed-experts call; x bf16)", "",
                  "| T | BLOCK_M | " + " | ".join(args.modes) + " |", "|---|---|" + "---|" * len(args.modes)]
        for T in args.tokens:
            bms = {m: moe_align.align_block_size(T * K_TOP, E, m == "w8a8") for m in args.modes}
            secs = {m: run_case(T, bms[m], None, args.iters, inputs(T, m)) for m in args.modes}
            bm = "/".join(str(b) for b in dict.fromkeys(bms.values()))
            base = secs.get("bf16")
            cells = [f"{secs[m] * 1e3:.3f}" + (f" (x{base / secs[m]:.2f})" if base and m != "bf16" else "")
                     for m in args.modes]
            lines.append(f"| {T} | {bm} | " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
        lines.append("")
    if args.no_sweep:
        return _write(args, lines)
    lines += ["| T | BLOCK_M | BLOCK_N | BLOCK_K | warps | stages | PROMOTE_K | ms | TFLOP/s | % peak |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    best, today = {}, {}
    block_ks = args.block_k or ([32, 64, 128] if args.weights == "bf16" else [64, 128, 256])
    for T in args.tokens:
        data = inputs(T, args.weights)
        flops = 4 * T * K_TOP * D * F
        bm_today = moe_align.align_block_size(T * K_TOP, E, args.weights == "w8a8")
        sec = run_case(T, bm_today, None, args.iters, data)
        today[T] = (bm_today, triton_moe.gemm_config(bm_today, torch.bfloat16, w8a8=args.weights == "w8a8"), sec)
        print(f"T={T} today BLOCK_M={bm_today} {today[T][1]}: {sec * 1e3:.3f} ms "
              f"{flops / sec / 1e12:.1f} TFLOP/s", flush=True)
        promotes = args.promote_k if args.weights == "w8a8" else [None]
        grid = itertools.product(args.block_m, args.block_n, block_ks, args.warps, args.stages, promotes)
        for bm, bn, bk, warps, stages, promote in grid:
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
            if promote is not None:
                if promote > bk:
                    continue
                cfg.update(PROMOTE_K=promote or bk)
            try:
                sec = run_case(T, bm, cfg, args.iters, data)
            except Exception as exc:  # noqa: BLE001 - out of shared memory / registers: not a candidate
                print(f"T={T} BLOCK_M={bm} {cfg}: skipped ({type(exc).__name__})", flush=True)
                torch.cuda.synchronize()
                continue
            tf = flops / sec
            lines.append(f"| {T} | {bm} | {bn} | {bk} | {warps} | {stages} | {cfg.get('PROMOTE_K', '-')} | "
                         f"{sec * 1e3:.3f} | {tf / 1e12:.1f} | "
                         f"{100 * tf / peak:.0f}% |")
            print(lines[-1], flush=True)
            if T not in best or sec < best[T][2]:
                best[T] = (bm, cfg, sec)
    lines += ["", "## Best per T (vs today's pick, same run)", "",
              "| T | today (BLOCK_M, config) | today ms | best (BLOCK_M, config) | best ms | best % peak | speed-up |",
              "|---|---|---|---|---|---|---|"]
    for T in args.tokens:
        tb, tc, ts = today[T]
        bb, bc, bs = best[T]
        flops = 4 * T * K_TOP * D * F
        lines.append(f"| {T} | {tb}, {tc} | {ts * 1e3:.3f} | {bb}, {bc} | {bs * 1e3:.3f} | "
                     f"{100 * flops / bs / peak:.0f}% | {ts / bs:.2f}x |")
    return _write(args, lines)


def _write(args, lines) -> int:
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"moe-gemm-sweep-{args.weights}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
