"""``hybrid-engine bench``: end-to-end decode throughput at several batch sizes (warm-up + median)."""
from __future__ import annotations

import statistics
import time

import numpy as np


def run_cli(args) -> int:
    import argparse

    from hybrid_engine import SamplingParams
    from hybrid_engine.cli import _llm
    # the timed runs repeat the warm-up's prompts: a prefix cache would serve them
    llm = _llm(argparse.Namespace(**{**vars(args), "enable_prefix_caching": False}))
    vocab = llm.engine.cfg.model.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for b in args.batch:
        prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)                      # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        med = statistics.median(times)
        rows.append((b, n, med, n / med))
    print(f"{'batch':>6} {'tokens':>8} {'median s':>9} {'tok/s':>9}")
    for b, n, med, tps in rows:
        print(f"{b:>6} {n:>8} {med:>9.3f} {tps:>9.1f}")
    return 0
