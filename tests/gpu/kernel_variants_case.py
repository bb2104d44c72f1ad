"""Run by test_kernel_variants_cuda.py in a fresh process (Triton's in-memory kernel caches are
per process, and the kernel tests launch on deliberately misaligned views): serve a varied
workload on CUDA (the warm-up), snapshot the kernels compiled, serve another one with other
lengths and arrivals, then print as JSON what ``value_recompiles`` finds between the two: variants
compiled only because an argument's *value* changed class.

usage: python kernel_variants_case.py MODEL_DIR"""
import json
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

from prefill_graph_harness import serve_with_arrivals          # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig   # noqa: E402
from hybrid_engine.triton_variants import compiled_variants, constexpr_values, value_recompiles   # noqa: E402


def serve(model: str, spec, seed: int) -> None:
    llm = LLM(model, dtype="bfloat16", device="cuda", max_num_seqs=8, max_num_batched_tokens=96,
              num_kv_blocks=512, block_size=4, enable_prefix_caching=True, mamba_checkpoint_interval=2,
              speculative_config=spec)
    eng, rng = llm.engine, np.random.default_rng(seed)
    system = rng.integers(3, 256, 37).tolist()
    # shared and unshared prompts of many lengths (token counts, sequence counts and offsets of
    # every residue mod 16), arriving while others decode, plus a few plain batches
    prompts = [(system if i % 3 else []) + rng.integers(3, 256, int(n)).tolist()
               for i, n in enumerate(rng.integers(1, 70, 40))]
    serve_with_arrivals(eng, prompts, SamplingParams(max_tokens=6, ignore_eos=True),
                        lambda e: e._stats["steps"] % 3 != 0)
    for n in (1, 3, 5, 8):
        llm.generate([rng.integers(3, 256, int(k)).tolist() for k in rng.integers(1, 90, n)],
                     SamplingParams(max_tokens=int(rng.integers(1, 9)), ignore_eos=True), use_tqdm=False)


if __name__ == "__main__":
    specs = (None, SpeculativeConfig("mtp", 2))
    for spec in specs:
        serve(sys.argv[1], spec, seed=7)
    warm = compiled_variants()
    for spec in specs:
        serve(sys.argv[1], spec, seed=8)
    # binary-search depths are constexprs, so value_recompiles does not see them: each kernel with
    # one must have compiled a single depth (search_iters), whatever the steps' sequence counts
    depths = {k: sorted(v) for k, v in constexpr_values("SEARCH_ITERS").items()}
    print(json.dumps({"kernels": len(warm), "recompiled": value_recompiles(warm, compiled_variants()),
                      "search_depths": depths}))
