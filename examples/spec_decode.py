"""Speculative decoding on a trained model: where each method helps, and by how much.

The embedded default model (a small Nemotron-H trained on Python source, with one MTP step, and a
smaller trained draft model sharing its tokenizer) runs two workloads greedily, with no
speculation and with each method proposing K tokens per step:

- "code completion": prompts that start a function or class. The MTP step and the draft model
  guess the next tokens from what the model has learnt, so they help here; n-gram lookup finds
  little to copy.
- "copy-heavy edit": the prompt holds a block of code and then starts writing it again with a small
  change (what an editor's "apply this edit" request looks like). The continuation repeats text of
  the prompt, so n-gram lookup proposes long runs that the target accepts.

For every (workload, method) it prints tokens/s, the speed-up over no speculation in the same run,
the mean acceptance length (tokens committed per target step: 1.00 means no draft token was ever
accepted, K + 1 the most) and whether the output equals the no-spec output (greedy speculation is
lossless, so it must). Speed-ups on a CPU are small: the target is tiny, so a verify step costs
nearly as much as the drafts it replaces; acceptance length is the number that carries over to a
GPU, where a step is host/bandwidth-bound and verifying K tokens costs about as much as one.

    python examples/spec_decode.py                              # embedded default model + draft
    python examples/spec_decode.py --model DIR --draft-model SMALL_DIR -k 4 --max-tokens 96
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

_BLOCK = '''def parse_header(line):
    """Split a header line into a name and a value."""
    name, _, value = line.partition(":")
    name = name.strip().lower()
    value = value.strip()
    if not name:
        raise ValueError("empty header name")
    return name, value
'''

WORKLOADS = {
    "code completion": [
        "import os\nimport sys\n\n\ndef main(argv):\n",
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
        "def read_lines(path):\n    with open(path",
        "    for key, value in sorted(",
    ],
    "copy-heavy edit": [
        # the restart ends at a line break, as an editor's request would: a prompt cut inside a
        # word ends on a token the block never had there (" na" of " name"), and this small
        # model then stops copying (n-gram acceptance length 1.63 against 3.67 when cut at a line)
        (_BLOCK + "\n\n# The same function, renamed to parse_field:\n\n"
         + "".join(_BLOCK.splitlines(keepends=True)[:3]).replace("parse_header", "parse_field")),
        "ITEMS = {\n" + "".join(f"    'item_{i}': {i},\n" for i in range(12)) + "}\n\nITEMS_COPY = {\n"
        + "".join(f"    'item_{i}': {i},\n" for i in range(3)),
    ],
}
METHODS = ("none", "ngram", "draft_model", "mtp")


def run(model, spec, prompts, max_tokens, device):
    llm = LLM(model, device=device, speculative_config=spec, seed=0)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)   # warm-up
    before = llm.stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    after = llm.stats()
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after.get("verify_steps", 0) - before.get("verify_steps", 0)
    accepted = after["drafts_accepted"] - before["drafts_accepted"]
    mean_len = 1 + accepted / steps if steps else 1.0
    return [o.outputs[0].token_ids for o in outs], n / dt, mean_len, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder; default: the embedded trained model")
    ap.add_argument("--draft-model", default=None,
                    help="draft for method draft_model; default: the embedded draft (with the default model)")
    ap.add_argument("-k", "--num-spec-tokens", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--show", action="store_true", help="print each workload's no-spec completions")
    args = ap.parse_args()
    if args.model is None:
        from hybrid_engine.default_model import default_draft_model_dir, default_model_dir
        args.model = str(default_model_dir())
        args.draft_model = args.draft_model or str(default_draft_model_dir())
    k = args.num_spec_tokens
    ok = True
    print(f"K = {k}, {args.max_tokens} tokens per prompt, greedy")
    print(f"{'workload':<16} {'method':<12} {'tok/s':>8} {'speed-up':>9} {'accept len':>11}  equal to none")
    for workload, prompts in WORKLOADS.items():
        base = None
        for method in METHODS:
            if method == "none":
                spec = None
            elif method == "draft_model":
                if args.draft_model is None:
                    print(f"{workload:<16} {method:<12} skipped: give --draft-model")
                    continue
                spec = SpeculativeConfig(method, k, model=args.draft_model)
            else:
                spec = SpeculativeConfig(method, k)
            try:
                toks, tps, mean_len, outs = run(args.model, spec, prompts, args.max_tokens, args.device)
            except ValueError as e:             # e.g. mtp on a model without MTP layers
                print(f"{workload:<16} {method:<12} skipped: {e}")
                continue
            if base is None:
                base = (toks, tps)
                if args.show:
                    for p, o in zip(prompts, outs):
                        print(f"--- {p[-60:]!r} -> {o.outputs[0].text!r}")
            same = toks == base[0]
            ok &= same
            print(f"{workload:<16} {method:<12} {tps:>8.1f} {tps / base[1]:>8.2f}x {mean_len:>11.2f}  "
                  f"{'-' if method == 'none' else same}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
