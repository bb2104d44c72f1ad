"""Main job: complete code prompts with the embedded default model (no download), or with --model DIR.

The embedded default is a small Nemotron-H (Mamba2, attention, MLP and MoE blocks, about 6M
parameters) trained on the Python source of a standard library and installed packages
(``python -m benchmarks.train --preset default``), so with no prompt given it completes a few
code prompts (``hybrid_engine.cli.DEFAULT_PROMPTS``) with plausible Python: the right indentation,
keywords, calls and names; being tiny it loses the thread after a line or two. The progress bar
shows requests finished and live input/output tokens/s; the last lines give the throughput (and
the acceptance with --spec).

    python examples/generate.py                                  # embedded model, greedy, 48 tokens
    python examples/generate.py --prompt "def fib(n):" --temperature 0.7 --sample-seed 1
    python examples/generate.py --spec mtp                       # the model's own MTP step drafts
    python examples/generate.py --spec draft_model               # the embedded trained draft model
    python examples/generate.py --model path/to/hf_dir --max-tokens 64 --spec ngram
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--max-tokens" or a.startswith("--max-tokens=") for a in argv):
        argv = ["--max-tokens", "48", *argv]
    sys.exit(main(["generate", *argv]))
