"""Tile sweep of the MoE prefill path (``triton_moe._grouped_gemm_kernel``, up and down) on the
Nemotron-3-Nano-30B-A3B widths: the whole routed-experts call (alignment, up GEMM with relu², down
GEMM with the routing weights, combine) at prefill token counts, for each rows-per-tile
(``BLOCK_M``, normally ``align_block_size``'s pick) and GEMM tile config. Reported as TFLOP/s of
the selected experts' FLOPs (4 * pairs * D * F) and as a share of the bf16 matmul peak measured in
the same run; the table ends with the best config per T beside the one ``triton_moe`` picks today.

    python benchmarks/moe_gemm_sweep.py --out $OUT          # H100, a few minutes (compiles)
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

from hybrid_engine.models import moe_ops, triton_moe  # noqa: E402

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


def inputs(T: int):
    g = torch.Generator(device="cuda").manual_seed(T)
    h = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w_up = (torch.randn(E, F, D, device="cuda", generator=g) / D ** 0.5).to(torch.bfloat16)
    w_down = (torch.randn(E, D, F, device="cuda", generator=g) / F ** 0.5).to(torch.bfloat16)
    ids = torch.rand(T, E, device="cuda", generator=g).topk(K_TOP, dim=1).indices.to(torch.int32)
    weights = torch.rand(T, K_TOP, device="cuda", generator=g)
    return h, w_up, w_down, ids, weights


def run_case(T, bm, cfg, iters, data):
    h, w_up, w_down, ids, weights = data
    old_bm, old_cfg = triton_moe.align_block_size, triton_moe.gemm_config
    triton_moe.align_block_size = lambda P, E_: bm
    triton_moe.gemm_config = (lambda bm_, dtype, swiglu=False: dict(cfg)) if cfg is not None else old_cfg
    out = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    try:
        fn = lambda: triton_moe.routed_experts_triton(h, w_up, w_down, ids, weights, force_grouped=True,  # noqa: E731
                                                      out=out)
        sec = timed(fn, iters)
        ref = moe_ops.grouped_experts_ref(h[:64], w_up, w_down, ids[:64].long(), weights[:64])
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
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    peak = matmul_peak()
    lines = [f"# MoE prefill grouped-GEMM tile sweep ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, {time.strftime('%Y-%m-%d')})", "",
             f"bf16 matmul peak {peak / 1e12:.0f} TFLOP/s (8192^3, same run); D={D} F={F} E={E} k={K_TOP}", "",
             "| T | BLOCK_M | BLOCK_N | BLOCK_K | warps | stages | ms | TFLOP/s | % peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    best, today = {}, {}
    for T in args.tokens:
        data = inputs(T)
        flops = 4 * T * K_TOP * D * F
        bm_today = moe_ops.align_block_size(T * K_TOP, E)
        sec = run_case(T, bm_today, None, args.iters, data)
        today[T] = (bm_today, triton_moe.gemm_config(bm_today, torch.bfloat16), sec)
        print(f"T={T} today BLOCK_M={bm_today} {today[T][1]}: {sec * 1e3:.3f} ms "
              f"{flops / sec / 1e12:.1f} TFLOP/s", flush=True)
        grid = itertools.product(args.block_m, [64, 128, 256], [32, 64, 128], [4, 8], [3, 4])
        for bm, bn, bk, warps, stages in grid:
            cfg = dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
            try:
                sec = run_case(T, bm, cfg, args.iters, data)
            except Exception as exc:  # noqa: BLE001 - out of shared memory / registers: not a candidate
                print(f"T={T} BLOCK_M={bm} {cfg}: skipped ({type(exc).__name__})", flush=True)
                torch.cuda.synchronize()
                continue
            tf = flops / sec
            lines.append(f"| {T} | {bm} | {bn} | {bk} | {warps} | {stages} | {sec * 1e3:.3f} | {tf / 1e12:.1f} | "
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
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe-gemm-sweep.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
