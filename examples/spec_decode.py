"""Speculative decoding demo: the same prompts with and without each method.

Prints acceptance and tokens/s per method and checks every output equals the no-spec output.

    python examples/spec_decode.py                     # embedded default model (it has MTP layers)
    python examples/spec_decode.py --model DIR --draft-model SMALL_DIR -k 4
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

PROMPTS = [  # repetitive text: n-gram lookup finds its drafts here
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the",
    "one two three four, one two three four, one two three",
    "In the morning the market was full of",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
]


def run(args, spec):
    llm = LLM(args.model, device=args.device, speculative_config=spec, seed=0)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)                     # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return [o.outputs[0].token_ids for o in outs], n / dt, llm.stats()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="HF folder; default: the embedded model")
    ap.add_argument("--draft-model", default=None, help="draft for method draft_model; default: the target")
    ap.add_argument("-k", "--num-spec-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    if args.model is None:
        from hybrid_engine.default_model import default_model_dir
        args.model = str(default_model_dir())
    k = args.num_spec_tokens
    base, base_tps, _ = run(args, None)
    print(f"{'method':<12} {'tok/s':>8} {'accept':>7} {'mean len':>9}  equal to no-spec")
    print(f"{'none':<12} {base_tps:>8.1f} {'-':>7} {'1.00':>9}  -")
    ok = True
    for method in ("ngram", "draft_model", "mtp"):
        spec = SpeculativeConfig(method, k, model=(args.draft_model or args.model) if method == "draft_model" else None)
        try:
            toks, tps, st = run(args, spec)
        except ValueError as e:
            print(f"{method:<12} skipped: {e}")
            continue
        same = toks == base
        ok &= same
        print(f"{method:<12} {tps:>8.1f} {st['acceptance_rate']:>7.2f} {st['mean_acceptance_length']:>9.2f}  {same}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
