"""Tile sweep of the MoE decode GEMV kernel (``triton_moe._pair_gemv_kernel``) on the
Nemotron-3-Nano-30B-A3B widths: the routed experts' up/down per (token, choice) pair, the shared
expert's up/down and the float32 router, at decode token counts. Each config is timed inside a
CUDA graph of --reps launches (median of --iters replays) and reported as achieved weight-read
bandwidth and as a share of the copy bandwidth measured in the same run; the table ends with the
best config per (projection, T) beside the one ``triton_moe`` picks today.

    python benchmarks/moe_gemv_sweep.py --out $OUT          # H100, about a minute
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

from hybrid_engine.mamba_cache.ops.triton_common import cdiv  # noqa: E402
from hybrid_engine.models import triton_moe  # noqa: E402

D, F, FS, E, K_TOP = 2688, 1856, 3712, 128, 6     # hidden, expert inner, shared inner, experts, top-k
PROJS = {  # name: (N, K, weight dtype, one weight, relu2, round)
    "expert_up": (F, D, torch.bfloat16, False, True, True),
    "expert_down": (D, F, torch.bfloat16, False, False, True),
    "shared_up": (FS, D, torch.bfloat16, True, True, True),
    "shared_down": (D, FS, torch.bfloat16, True, False, True),
    "router": (E, D, torch.float32, True, False, False),
}


def copy_bw(nbytes=1 << 30) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (time.perf_counter() - t)


def bench_graph(fn, reps: int, iters: int) -> float:
    """Median seconds per launch of ``fn`` captured ``reps`` times in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        g.replay()
        en.record()
        en.synchronize()
        times.append(st.elapsed_time(en) / 1e3 / reps)
    return statistics.median(times)


def case(name: str, T: int, bn: int, bk: int, warps: int, stages: int | None, reps: int, iters: int):
    N, Kd, wdt, one, relu2, rnd = PROJS[name]
    P = T if one else T * K_TOP
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T if name != "expert_down" else P, Kd, device="cuda", generator=g).to(torch.bfloat16)
    if one:
        w = torch.randn(N, Kd, device="cuda", generator=g).to(wdt)
        ids = torch.zeros(1, dtype=torch.int32, device="cuda")
        s_we = 0
    else:
        w = torch.randn(E, N, Kd, device="cuda", generator=g).to(wdt)
        ids = torch.randperm(E, device="cuda", generator=g)[:P].to(torch.int32)   # distinct experts
        s_we = w.stride(0)
    out_dtype = torch.bfloat16 if rnd else torch.float32
    out = torch.empty(P, N, dtype=out_dtype, device="cuda")
    a_div = K_TOP if name == "expert_up" else 1
    kw = dict(RELU2=relu2, BLOCK_N=bn, BLOCK_K=bk, ONE_WEIGHT=one, ROUND=rnd, num_warps=warps)
    if stages is not None:
        kw["num_stages"] = stages
    grid = (cdiv(N, bn), P)

    def fn():
        triton_moe._pair_gemv_kernel[grid](x, w, ids, out, N, Kd, a_div, x.stride(0), s_we,
                                           w.stride(-2), out.stride(0), **kw)
    sec = bench_graph(fn, reps, iters)
    read = P * N * Kd * w.element_size()
    return sec, read / sec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--projs", nargs="+", default=list(PROJS))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    bw = copy_bw()
    lines = [f"# MoE decode GEMV tile sweep ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"triton {triton.__version__}, {time.strftime('%Y-%m-%d')})", "",
             f"copy bandwidth {bw / 1e9:.0f} GB/s; widths D={D} F={F} shared={FS} E={E} k={K_TOP}", "",
             "| proj | T | BLOCK_N | BLOCK_K | warps | stages | us | GB/s | % copy |", "|---|---|---|---|---|---|---|---|---|"]
    best, today = {}, {}
    for name in args.projs:
        for T in args.tokens:
            grid = itertools.product([4, 8, 16, 32], [64, 128, 256, 512], [2, 4, 8], [None])
            for bn, bk, warps, stages in grid:
                if bn * bk > 16384 or (PROJS[name][2] == torch.float32 and bn * bk > 8192):
                    continue
                try:
                    sec, rate = case(name, T, bn, bk, warps, stages, args.reps, args.iters)
                except Exception as e:          # an invalid config for this Triton: skip it
                    print(f"skip {name} T={T} {bn}x{bk} w{warps}: {type(e).__name__}", flush=True)
                    continue
                row = (sec, rate, bn, bk, warps, stages)
                if (name, T) not in best or sec < best[name, T][0]:
                    best[name, T] = row
                lines.append(f"| {name} | {T} | {bn} | {bk} | {warps} | {stages} | {sec * 1e6:.2f} | "
                             f"{rate / 1e9:.0f} | {100 * rate / bw:.0f}% |")
                if (bn, bk, warps, stages) == ((16, 64, 4, None) if PROJS[name][2] == torch.float32 else (16, 128, 4, None)):
                    today[name, T] = row
            print(name, T, "best", best[name, T][2:], f"{best[name, T][0] * 1e6:.2f} us",
                  "today", today.get((name, T), (0,))[0] * 1e6, flush=True)
    lines += ["", "## Best per projection and T (beside today's config: BLOCK_N 16, BLOCK_K 128 (64 for float32), 4 warps)", "",
              "| proj | T | best (BLOCK_N, BLOCK_K, warps, stages) | us | % copy | today us | today % copy |",
              "|---|---|---|---|---|---|---|"]
    for (name, T), (sec, rate, *cfg) in best.items():
        t = today.get((name, T))
        lines.append(f"| {name} | {T} | {tuple(cfg)} | {sec * 1e6:.2f} | {100 * rate / bw:.0f}% | "
                     f"{t[0] * 1e6 if t else float('nan'):.2f} | {100 * t[1] / bw if t else float('nan'):.0f}% |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_gemv_sweep.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
