"""MTP speculative decoding with the drafter's CUDA graphs on and off (the target's graphs on in
both), on a small Nemotron-H test model with MTP weights. Decode tokens/s: median of 3 timed
generate calls after one warm-up call, both modes in one process.

    python benchmarks/mtp_graphs.py [--batch 8] [--tokens 128] [--k 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from hybrid_engine.models.synthetic import make_hf_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    model = make_hf_model(Path(tempfile.mkdtemp()) / "mtp", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1,
                          hidden_size=args.hidden)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 24).tolist() for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    llm = LLM(model, dtype="bfloat16", device="cuda", max_num_seqs=args.batch,
              speculative_config=SpeculativeConfig("mtp", args.k, adaptive=False), enable_prefix_caching=False)
    graphs, verify_graphs = llm.engine.drafter.graphs, llm.engine.drafter.verify_graphs
    rows = []
    for mode in ("graphs", "eager MTP"):
        llm.engine.drafter.graphs = graphs if mode == "graphs" else None
        llm.engine.drafter.verify_graphs = verify_graphs if mode == "graphs" else {}
        llm.generate(prompts, params, use_tqdm=False)                        # warm-up
        times, outs = [], None
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        acc = statistics.mean(o.metrics["mean_acceptance_length"] for o in outs)
        rows.append((mode, n / statistics.median(times), acc))
    print(f"MTP K={args.k}, B={args.batch}, {args.tokens} tokens/request, hidden {args.hidden}, "
          f"{torch.cuda.get_device_name()}")
    print("| MTP drafter | decode tok/s | acceptance length |\n|---|---|---|")
    for mode, tps, acc in rows:
        print(f"| {mode} | {tps:.0f} | {acc:.2f} |")
    print(f"graphs / eager: {rows[0][1] / rows[1][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
