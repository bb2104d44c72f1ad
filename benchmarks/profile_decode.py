"""Where a decode step's GPU time goes (CUDA): per-kernel times of steady-state decode steps.

Builds the engine on random bfloat16 weights, admits --batch requests, runs until every request is
decoding, then profiles --steps engine steps with torch.profiler (CUDA activities; kernels inside
CUDA-graph replays are reported too) and prints, per step: the kernels grouped by name (calls,
microseconds), the total kernel time, the wall time per step, and the share taken by GEMMs.

    python benchmarks/profile_decode.py --shape 8b|nano --batch 1 [--quantization fp8|nvfp4] [--eager] [--top 30] [--out f.txt]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPE_8B, SHAPE_MEDIUM, SHAPE_SMALL, random_weights, write_config  # noqa: E402
from hybrid_engine import LLM, SamplingParams  # noqa: E402

from benchmarks.moe import SHAPE_NANO  # noqa: E402

SHAPES = {"8b": SHAPE_8B, "small": SHAPE_SMALL, "medium": SHAPE_MEDIUM, "nano": SHAPE_NANO}
GEMM_KEYS = ("gemm", "gemv", "cutlass", "sm90", "xmma", "splitk", "cublas", "nvjet", "_linear_")


def kernel_rows(prof, steps: int):
    """[(name, calls per step, us per step)] sorted by time, from the profiler's device events."""
    acc = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        dev_t = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0)
        if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA and dev_t > 0:
            a = acc[ev.name]
            a[0] += 1
            a[1] += dev_t
    rows = [(k, v[0] / steps, v[1] / steps) for k, v in acc.items()]
    return sorted(rows, key=lambda r: -r[2])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--device", default="cuda", help="cpu: smoke test of the script only")
    ap.add_argument("--quantization", choices=("fp8", "nvfp4"), default=None,
                    help="quantize the random bf16 weights at load (LLM(quantization=...))")
    args = ap.parse_args()
    torch.manual_seed(0)
    model_dir = write_config(Path(tempfile.mkdtemp()) / args.shape, SHAPES[args.shape])
    with random_weights():
        llm = LLM(model_dir, dtype="bfloat16", device=args.device, max_num_seqs=max(8, args.batch),
                  max_model_len=1024, kv_cache_memory_fraction=0.25, enforce_eager=args.eager,
                  enable_prefix_caching=False, quantization=args.quantization)
    eng = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    vocab = eng.cfg.model.vocab_size
    for i in range(args.batch):
        eng.add_request(eng.make_request(rng.integers(3, vocab, 32).tolist(), params, f"r{i}"))
    for _ in range(8):                       # prefill, then settle into decode
        eng.step()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    sync()
    wall_us = (time.perf_counter() - t0) / args.steps * 1e6
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            eng.step()
        sync()
    rows = kernel_rows(prof, args.steps)
    total = sum(r[2] for r in rows)
    gemm = sum(r[2] for r in rows if any(k in r[0].lower() for k in GEMM_KEYS))
    ncalls = sum(r[1] for r in rows)
    lines = [f"shape {args.shape}, weights {args.quantization or 'bf16'}, batch {args.batch}, "
             f"{'eager' if args.eager else 'CUDA graphs'}, "
             f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}",
             f"wall per step {wall_us:.0f} us (unprofiled); kernel time per step {total:.0f} us in "
             f"{ncalls:.0f} kernels; GEMM kernels {gemm:.0f} us ({100 * gemm / max(total, 1):.0f}%), "
             f"other kernels {total - gemm:.0f} us",
             "", "| kernel | calls/step | us/step | % |", "|---|---|---|---|"]
    for name, calls, us in rows[:args.top]:
        lines.append(f"| {name[:90]} | {calls:.0f} | {us:.1f} | {100 * us / max(total, 1):.1f}% |")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
