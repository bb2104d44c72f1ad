"""Where one long prefill of the 8B shape goes, bf16 or a quantized mode (issue 17): the wall time
of ``--tokens`` prompt tokens with ``max_tokens=1`` (median of the last ``--runs`` - 1 of ``--runs``
runs; the first compiles), then a torch-profiler pass summing GPU time by kernel. One mode per
process: run it twice (bf16, fp8) in one device call for a same-machine ratio. Random weights.

    HYBRID_ENGINE_PDL=0 python benchmarks/quant_prefill_profile.py bf16
    HYBRID_ENGINE_PDL=0 python benchmarks/quant_prefill_profile.py fp8 --tokens 8192

(``HYBRID_ENGINE_PDL=0``: kernel times without a dependent launch's wait inside them.)
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPE_8B, random_weights, write_config  # noqa: E402
from benchmarks.profiling import profile_prefill  # noqa: E402
from hybrid_engine import LLM, SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--top", type=int, default=28, help="kernels listed")
    args = ap.parse_args()
    md = write_config(Path(tempfile.mkdtemp()) / "8b", SHAPE_8B)
    with random_weights():
        llm = LLM(str(md), dtype="bfloat16", device="cuda", quantization=None if args.mode == "bf16" else args.mode,
                  max_num_seqs=8, max_num_batched_tokens=args.tokens, max_model_len=args.tokens + 128,
                  kv_cache_memory_fraction=0.25, kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    prompt = np.random.default_rng(0).integers(3, 100000, args.tokens).tolist()
    sp = SamplingParams(max_tokens=1)
    ts = []
    for _ in range(args.runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([prompt], sp, use_tqdm=False)
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    print(f"{args.mode} prefill {args.tokens} ms {[round(x, 1) for x in ts]} median {np.median(ts[1:]):.1f}")
    profile_prefill(llm, prompt, sp, top=args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
