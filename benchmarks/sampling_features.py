"""Cost of the sampling features (issue 18) on the decode loop: the same batch generated plainly and
with penalties + logit_bias + bad-word-free processing, with logprobs, with both, with n > 1
(the prompt prefilled once per group), each without and with n-gram speculation.

Per configuration: warm-up run, then ``--repeats`` timed runs; reported: median wall time,
output tokens per second, and ms per decode step (wall / steps), as JSON (and a table on stdout).
Random weights of the chosen shape (no checkpoint), bf16 on CUDA.

    python benchmarks/sampling_features.py --shape 8b --batch 32 --out $OUT
    python benchmarks/sampling_features.py --device cpu --shape tiny --batch 2 --max-tokens 4   # smoke
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPE_8B, SHAPE_MEDIUM, SHAPE_SMALL, random_weights, save_json, write_config  # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

SHAPE_TINY = dict(pattern="M-M*-", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                  vocab_size=512)
SHAPES = {"tiny": SHAPE_TINY, "small": SHAPE_SMALL, "medium": SHAPE_MEDIUM, "8b": SHAPE_8B}


def configs(max_tokens: int) -> dict[str, tuple[SamplingParams, int]]:
    """name -> (params, prompts per batch divisor: n > 1 runs batch / n prompts)."""
    base = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    processed = dataclasses.replace(base, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2,
                                    logit_bias={7: 1.0, 11: -1.0})
    return {
        "plain": (base, 1),
        "penalties+bias": (processed, 1),
        "logprobs5": (dataclasses.replace(base, logprobs=5), 1),
        "penalties+logprobs5": (dataclasses.replace(processed, logprobs=5), 1),
        "sampled": (dataclasses.replace(base, temperature=0.8, seed=1), 1),
        "n4 sampled": (dataclasses.replace(base, temperature=0.8, seed=1, n=4), 4),
    }


def run(llm, prompts, params, repeats: int) -> dict:
    llm.generate(prompts, params, use_tqdm=False)                       # warm-up (graphs, allocation)
    walls, steps, tokens = [], [], 0
    for _ in range(repeats):
        s0 = llm.engine.stats(expert_load=False)["steps"]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        steps.append(llm.engine.stats(expert_load=False)["steps"] - s0)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    wall = statistics.median(walls)
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall,
            "ms_per_step": 1e3 * wall / statistics.median(steps)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    model_dir = write_config(Path(tempfile.mkdtemp()) / args.shape, SHAPES[args.shape])
    rng = np.random.default_rng(0)
    vocab = SHAPES[args.shape].get("vocab_size", 131072)
    results = {}
    for spec_name, spec in (("no spec", None), ("ngram k=3", SpeculativeConfig("ngram", 3))):
        with random_weights():
            llm = LLM(model_dir, dtype="bfloat16" if args.device == "cuda" else "float32", device=args.device,
                      max_num_seqs=args.batch, speculative_config=spec,
                      max_num_batched_tokens=max(2048, args.batch * 4), enable_prefix_caching=False)
        for name, (params, per) in configs(args.max_tokens).items():
            prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(max(1, args.batch // per))]
            r = results[f"{spec_name} | {name}"] = run(llm, prompts, params, args.repeats)
            print(f"{spec_name:10s} {name:22s} {r['tok_per_s']:10.1f} tok/s {r['ms_per_step']:8.2f} ms/step", flush=True)
        del llm
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"sampling_features_{args.shape}_b{args.batch}.json",
              {"args": {k: str(v) for k, v in vars(args).items()}, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
