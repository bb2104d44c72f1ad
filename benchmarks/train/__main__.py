"""``python -m benchmarks.train --preset {tiny,default,bench,bench-large} --out DIR [--device cuda] [--seed 0]
[--time-budget-s S] [--max-steps N]``: see benchmarks/train/__init__.py."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from .models import PRESETS, preset
from .train import run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.train", description=__doc__)
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--out", required=True, help="output folder (target/, draft/, train_report.json, ...)")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="wall-time limit of the training loop (default: the preset's)")
    ap.add_argument("--max-steps", type=int, default=None, help="step limit (default: the preset's)")
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--corpus-bytes", type=int, default=None, help="train text cap in bytes (default: the preset's)")
    ap.add_argument("--heldout-bytes", type=int, default=None, help="held-out text cap in bytes")
    ap.add_argument("--eval-windows", type=int, default=None, help="held-out windows scored after training")
    ap.add_argument("--bf16-autocast", action=argparse.BooleanOptionalAction, default=None,
                    help="train under bf16 autocast on CUDA (default: the preset's; bench-large: on)")
    ap.add_argument("--copy-frac", type=float, default=None,
                    help="share of each batch's windows that repeat a piece of text (default: the preset's: "
                         "0.5 for default and bench-large, 0 for the others)")
    ap.add_argument("--log-every", type=int, default=10, help="steps between loss reads (host syncs)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = ap.parse_args(argv)
    for name, v in (("time_budget_s", args.time_budget_s), ("max_steps", args.max_steps),
                    ("batch_size", args.batch_size), ("corpus_bytes", args.corpus_bytes),
                    ("heldout_bytes", args.heldout_bytes), ("eval_windows", args.eval_windows)):
        if v is not None and v <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0, got {v}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    p = preset(args.preset, time_budget_s=args.time_budget_s, max_steps=args.max_steps,
               batch_size=args.batch_size, corpus_bytes=args.corpus_bytes, heldout_bytes=args.heldout_bytes,
               eval_windows=args.eval_windows, bf16_autocast=args.bf16_autocast, copy_frac=args.copy_frac)
    report = run(p, args.out, seed=args.seed, device=args.device, log_every=args.log_every,
                 progress=not args.no_progress)
    summary = {k: report[k] for k in ("preset", "device", "params", "steps", "tokens_seen", "timings_s",
                                      "final_train_loss", "heldout_loss")}
    summary["corpus"] = report["corpus"]
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
