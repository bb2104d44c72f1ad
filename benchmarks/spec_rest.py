"""What speculation costs where nothing is accepted (issue 15: "on random weights (AL ~1) spec runs at
>= 0.95x of no spec"): end-to-end time per output token of a batch-1 generate on a random-weight
shape, no speculation against each method with adaptive speculation on (the default) and, with
``--fixed``, off. One process; each round builds every engine once, in order, and the ratio to
``none`` is taken within the round; the table shows the median over rounds. Greedy outputs must
equal ``none``'s (asserted). Each row also lists its steps by plan and drafts verified
(``common.StepTimeline``): an adaptive engine that rests takes width-0 steps.

Why a separate script: ``spec_step_cost.py`` times the interval between decode launches. For a
resting n-gram engine on the H200 it read 1.34x and 1.97x a greedy step in two rounds, while an
end-to-end timing in another process read parity (0.390 against 0.396 ms per token,
``results/2026-11-29-spec-adaptive-two-rates-h200.md``). The goal is stated end to end, so this
measures end to end.

    python -m benchmarks.spec_rest --shape bench-large --out $OUT              # H100/H200
    python -m benchmarks.spec_rest --shape bench-large --methods none,ngram,mtp,draft_model --fixed --out $OUT
    python -m benchmarks.spec_rest --shape bench-large --cost --out $OUT      # also adaptive_step_cost
    python -m benchmarks.spec_rest --shape bench-large --untimed --out $OUT   # also without the cost gate
    python -m benchmarks.spec_rest --shape tiny --device cpu --tokens 16 --rounds 1 --out /tmp/sr   # CPU smoke

Writes ``spec_rest.json`` and ``spec_rest.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import StepTimeline, random_weights, save_json  # noqa: E402
from benchmarks.spec_timing import free, time_cell  # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

PROMPT = [(7 * i) % 200 + 3 for i in range(48)] * 2    # repeats: the n-gram drafter finds drafts to reject


def measure(target: str, draft: str, method: str, adaptive, args) -> dict:
    """One engine through ``spec_timing.time_cell`` (a warm-up, then the median of ``args.runs``
    timed generates; ``adaptive``: False, True, "cost" (adaptive_step_cost) or "untimed" (no cost
    gate: ``AdaptiveDrafts.stop_timing``)): seconds per output
    token, acceptance length, steps by plan and width, and the tokens of its last run."""
    spec = None if method == "none" else SpeculativeConfig(
        method, args.k, adaptive=bool(adaptive), adaptive_step_cost=adaptive == "cost",
        model=draft if method == "draft_model" else None)
    with random_weights(std=args.std):
        llm = LLM(target, dtype=args.dtype, device=args.device, max_num_seqs=4, speculative_config=spec,
                  max_model_len=len(PROMPT) + args.tokens + 64, enable_prefix_caching=False)
    if adaptive == "untimed":                     # the acceptance rule alone (no cost gate)
        llm.engine.runner.policy.stop_timing()
    timeline = StepTimeline(llm.engine.runner)
    groups = [([PROMPT], [SamplingParams(max_tokens=args.tokens, ignore_eos=True)])]
    secs, outs, st = time_cell(llm, groups, argparse.Namespace(repeats=args.runs, device=args.device), timeline)
    row = dict(method=method, adaptive=adaptive if method != "none" else None, k=0 if spec is None else args.k,
               s_per_token=secs / args.tokens, acceptance_length=st["acceptance_length"],
               steps_by_width=st["steps_by_width"], tokens=outs[0])
    llm.shutdown()
    del llm
    free()
    return row


def _interval(rounds: list[dict], key: str) -> str:
    """The median over rounds of a plan/width's median step interval (ms), '-' where no round timed it
    (the step counts are the last round's)."""
    ms = [r["steps_by_width"][key]["interval_ms"] for r in rounds
          if r["steps_by_width"].get(key, {}).get("interval_ms") is not None]
    return "-" if not ms else f"{statistics.median(ms):.3f}"


def markdown(rows: list[dict], args, device_name: str) -> str:
    lines = [f"# spec_rest ({device_name}, shape {args.shape}, {args.dtype})", "",
             f"batch 1, prompt {len(PROMPT)} tokens, {args.tokens} new tokens, K = {args.k}, random weights "
             f"(std {args.std}); per engine the median of {args.runs} generates after a warm-up; ratio: "
             f"none's time per token over the method's, within a round, median of {args.rounds} rounds", "",
             "| method | adaptive | ms per token (median over rounds) | vs none | per round | AL | steps per run by plan/width (interval ms, median over rounds) |",
             "|---|---|---|---|---|---|---|"]
    keys = sorted({(r["method"], r["adaptive"]) for r in rows}, key=lambda k: (k[0] != "none", k[0], str(k[1])))
    for method, adaptive in keys:
        mine = [r for r in rows if r["method"] == method and r["adaptive"] == adaptive]
        ratios = [r["vs_none"] for r in mine]
        last = mine[-1]
        widths = ", ".join(f"{key} {v['steps']:g} ({_interval(mine, key)})" for key, v in last["steps_by_width"].items())
        al = "-" if last["acceptance_length"] is None else f"{last['acceptance_length']:.2f}"
        label = {None: "-", True: "on", False: "off"}.get(adaptive, adaptive)     # or "cost" / "untimed"
        lines.append(f"| {method} | {label} | "
                     f"{statistics.median(r['s_per_token'] for r in mine) * 1e3:.4f} | {statistics.median(ratios):.2f}x | "
                     f"{', '.join(f'{x:.2f}' for x in ratios)} | {al} | {widths} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["bench-large", "8b", "nano", "tiny"], default="bench-large")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--methods", default="none,ngram,mtp,draft_model")
    ap.add_argument("--fixed", action="store_true", help="also each method with adaptive speculation off")
    ap.add_argument("--cost", action="store_true", help="also each method with adaptive_step_cost")
    ap.add_argument("--untimed", action="store_true", help="also each method adaptive without the cost gate")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--runs", type=int, default=5, help="timed generates per engine")
    ap.add_argument("--rounds", type=int, default=2, help="every engine built again, in order")
    ap.add_argument("--std", type=float, default=0.02, help="random weights' init std")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from benchmarks.spec_shapes import shape_dirs
    target, draft = shape_dirs(args.shape, Path(tempfile.mkdtemp(prefix="spec-rest-")))
    methods = [m for m in args.methods.split(",") if m]
    if "none" not in methods:
        methods.insert(0, "none")
    cells = [(m, None) for m in methods if m == "none"] + [(m, True) for m in methods if m != "none"]
    if args.fixed:
        cells += [(m, False) for m in methods if m != "none"]
    if args.cost:
        cells += [(m, "cost") for m in methods if m != "none"]
    if args.untimed:
        cells += [(m, "untimed") for m in methods if m != "none"]
    rows = []
    for rnd in range(args.rounds):
        ref = None
        for method, adaptive in cells:
            row = measure(str(target), str(draft), method, False if adaptive is None else adaptive, args)
            row["round"] = rnd
            if method == "none":
                ref = row
            elif row["tokens"] != ref["tokens"]:
                raise SystemExit(f"{method} (adaptive={adaptive}) changed the greedy tokens of round {rnd}")
            row["vs_none"] = ref["s_per_token"] / row["s_per_token"]
            rows.append(row)
            print(f"[round {rnd}] {method} adaptive={adaptive}: {row['s_per_token'] * 1e3:.4f} ms/token, "
                  f"{row['vs_none']:.2f}x none, AL {row['acceptance_length']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = args.device
    if args.device.startswith("cuda"):
        import torch
        device_name = torch.cuda.get_device_name()
    save_json(args.out / "spec_rest.json", dict(meta=dict(device=device_name, shape=args.shape, dtype=args.dtype,
                                                          k=args.k, tokens=args.tokens, runs=args.runs,
                                                          rounds=args.rounds, std=args.std),
                                                rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows]))
    md = markdown(rows, args, device_name)
    (args.out / "spec_rest.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
