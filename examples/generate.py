"""Main job: generate text with the embedded default model (no download), or with --model DIR.

    python examples/generate.py                      # embedded small Nemotron-H, greedy
    python examples/generate.py --model path/to/hf_dir --max-tokens 64 --spec ngram
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid_engine.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
