"""What one decode step costs with and without speculation, at batch 1 (or ``--batch B``): the step
interval (rank 0's launch cadence, ``benchmarks.common.StepClock``), the host time inside ``execute``, and the GPU
time per step by kernel (torch profiler over steady steps, kernels replayed from CUDA graphs
included). Answers "where does a K=3 verify step spend its time compared with a greedy step".

    python benchmarks/spec_step_cost.py --out $OUT                    # the embedded trained default model
    python benchmarks/spec_step_cost.py --model DIR --methods none,ngram,mtp --k 3 --out $OUT
    python benchmarks/spec_step_cost.py --shape 8b --forced 0.81 --dtype bfloat16 --out $OUT
        # a random-weight shape (its MTP layer; draft: the small shape), every draft accepted with
        # probability 0.81 (forced acceptance, benchmark only; the fused verify-step plan draws the coins)
    python benchmarks/spec_step_cost.py --shape bench-large --methods none,ngram,mtp --out $OUT
        # the trained spec benchmark's target and draft shapes (benchmarks/train preset bench-large)
        # with random weights: its step costs without training first
    --methods none,mtp,mtp:32768     # "mtp:N": MTP drafting over the first N vocabulary ids
    --methods none,mtp:fp8,draft_model:fp8,mtp:32768:fp8   # ":fp8": the drafter's weights in FP8
    --methods none,ngram:adaptive,mtp:adaptive   # ":adaptive": adaptive speculation on (on random
        # weights nothing is accepted and the rows rest at width 0: what a resting step costs)
    --batch 8                        # B requests at once (the prompt rotated per row)

Adaptive speculation is off (every step verifies K drafts) unless a method says ``:adaptive``, so
the spec rows are the cost of a full K-draft step whatever the acceptance. ``--rounds R`` measures every method R times, interleaved
(none, ngram, ..., none, ngram, ...: a fresh engine each time), and reports each method's median
step and the ratio of medians: the greedy step is partly host-bound and its interval moved by up to
27% between calls on the same machine kind, so one sample per method is not a ratio to trust.
Kernels are profiled in the first round only.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import tempfile
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import StepClock, StepTimeline, random_weights, save_json  # noqa: E402
from benchmarks.profiling import kernel_times  # noqa: E402
from benchmarks.spec_timing import free  # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from hybrid_engine.default_model import default_draft_model_dir, default_model_dir  # noqa: E402


DRAFT_DIR: list = [None]          # --draft-model


def top_kernels(prof, steps: int, n: int = 12) -> list[tuple[str, float, float]]:
    """[(kernel name, GPU us per step, launches per step)] of the ``n`` costliest kernels."""
    times = kernel_times(prof, 60)
    total_ms, launches = sum(ms for _, _, ms in times), sum(c for _, c, _ in times)
    return [("(all kernels)", round(total_ms * 1e3 / steps, 2), round(launches / steps, 1))] + \
        [(k, round(ms * 1e3 / steps, 2), round(c / steps, 2)) for k, c, ms in times[:n]]


def measure(model: str, method: str, k: int, dtype: str, prompt: list[int], tokens: int, profile: bool = True,
            forced: float | None = None, random: bool = False, batch: int = 1, top: int = 12) -> dict:
    draft = str(DRAFT_DIR[0]) if method.startswith("draft_model") else None
    # "mtp:N": draft_vocab_size N; ":fp8" (mtp / draft_model): the drafter's weights in FP8
    name, *opts = method.split(":")
    rows = next((int(o) for o in opts if o.isdigit()), None)
    quant = "fp8" if "fp8" in opts else None
    adaptive = "adaptive" in opts           # ":adaptive": the engine's adaptive policy (random weights: it rests)
    spec = None if method == "none" else SpeculativeConfig(name, k, model=draft, adaptive=adaptive,
                                                           forced_acceptance_rate=forced,
                                                           draft_vocab_size=rows, quantization=quant)
    with random_weights() if random else contextlib.nullcontext():
        llm = LLM(model, dtype=dtype, device="cuda", max_num_seqs=max(8, batch), speculative_config=spec,
                  max_model_len=len(prompt) + tokens + 64, enable_prefix_caching=False)
    clock = StepClock(llm.engine)
    host: list[float] = []
    inner = llm.engine.runner.execute              # the clock's wrapper: its time is in host_ms too

    def timed_execute(sched):
        t0 = time.perf_counter()
        h = inner(sched)
        host.append(time.perf_counter() - t0)
        return h
    llm.engine.runner.execute = timed_execute
    timeline = StepTimeline(llm.engine.runner)     # which plan takes each step (fused or general)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    # rows differ (rotated prompts) so a batched step is not B copies of one row's work
    prompts = [prompt[i:] + prompt[:i] for i in range(batch)]
    run = lambda: llm.generate(prompts, params, use_tqdm=False)  # noqa: E731
    host.clear()
    timeline.clear()
    step = clock.step_time(run, runs=5, warmup=1)
    host_ms = float(np.median(host)) * 1e3          # before the profiled run (its syncs are in execute)
    steps_by_plan = {name: int(n) for name, n in timeline.steps_by_plan(runs=6).items()}   # per run (1 warm-up + 5 timed)
    # max_model_len bounds the captured graphs' attention split count: part of what a row measures
    row = dict(method=method, dtype=dtype, k=0 if spec is None else k, batch=batch, step_ms=step * 1e3,
               host_execute_ms=host_ms, steps_by_plan=steps_by_plan, max_model_len=len(prompt) + tokens + 64,
               acceptance_length=llm.stats()["mean_acceptance_length"])
    if profile:
        clock.profile = (6, 16)
        clock.run(run)
        row.update(profiled_steps=clock.profiled_steps, kernels_us_per_step=top_kernels(clock.prof, clock.profiled_steps, top))
    llm.shutdown()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target folder (default: the embedded trained model)")
    ap.add_argument("--draft-model", default=None, help="draft folder for method draft_model (default: the embedded draft)")
    ap.add_argument("--methods", default="none,ngram,mtp,draft_model")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--batch", type=int, default=1, help="requests decoded together")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats of every method")
    ap.add_argument("--shape", choices=["8b", "nano", "bench-large"], default=None,
                    help="a random-weight shape instead of --model (draft model: the small shape)")
    ap.add_argument("--forced", type=float, default=None,
                    help="forced acceptance rate of every draft (benchmark only; drawn inside the fused verify-step plan)")
    ap.add_argument("--top", type=int, default=12, help="kernels listed per method (costliest first)")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    DRAFT_DIR[0] = args.draft_model or str(default_draft_model_dir())
    args.model = args.model or str(default_model_dir())
    if args.shape:
        from benchmarks.spec_shapes import shape_dirs
        target, draft = shape_dirs(args.shape, Path(tempfile.mkdtemp(prefix="spec-step-cost-")))
        args.model, DRAFT_DIR[0] = str(target), str(draft)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")   # the engine logs its paths once
    args.out.mkdir(parents=True, exist_ok=True)
    prompt = [(7 * i) % 200 + 3 for i in range(48)] * 2          # repeats: n-gram finds drafts
    methods = args.methods.split(",")
    rows, rounds = [], []
    for rnd in range(args.rounds):
        rounds.append({})
        for method in methods:
            r = measure(args.model, method, args.k, args.dtype, prompt, args.tokens, profile=rnd == 0,
                        forced=args.forced, random=args.shape is not None, batch=args.batch,
                        top=args.top)
            free()        # the engine's cycles: else the next one sizes its KV cache beside it (8B on an H200: OOM)
            r["round"] = rnd
            rows.append(r)
            rounds[-1][method] = r["step_ms"]
            print(f"\n[round {rnd}] {method} K={r['k']}: step {r['step_ms']:.3f} ms, host in execute "
                  f"{r['host_execute_ms']:.3f} ms, AL {r['acceptance_length']:.2f}, steps by plan {r['steps_by_plan']}", flush=True)
            for name, us, n in r.get("kernels_us_per_step", []):
                print(f"  {us:9.2f} us  {n:6.2f}x  {name}")
    summary = {m: float(np.median([rd[m] for rd in rounds])) for m in methods}
    print("\nmedian step over %d rounds (ms): %s" % (args.rounds, {m: round(v, 4) for m, v in summary.items()}))
    if "none" in summary:
        for m in methods:
            per_round = [rd[m] / rd["none"] for rd in rounds]
            print(f"{m}: {summary[m] / summary['none']:.2f}x the greedy step (ratio of medians; per round "
                  f"{', '.join(f'{x:.2f}' for x in per_round)})")
    rows.append(dict(summary_median_step_ms=summary, rounds=args.rounds))
    save_json(args.out / "spec_step_cost.json", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
