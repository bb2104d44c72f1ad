"""GPU idle gap between consecutive steps, async scheduling on vs off (CUDA).

An event is recorded on the main stream right before a step's first device work and right after
its last kernel; gap(N) = start(N+1) - end(N) on the GPU clock. When step N+1 was enqueued before
step N finished, start(N+1) fires immediately after end(N), so the gap reads ~0.

Also per step: host busy (wall minus the time blocked in the D2H wait) and host wait, the GPU span
of each step and of its forward alone (graph replay; for a greedy step graph, the replay of
input preparation + forward + argmax). The gap follows host busy: when the host
needs longer per step than the GPU, the GPU waits whatever the overlap. The timing events are
made before the loop, so the measurement adds no allocation to the host path it measures.

    python benchmarks/async_gap.py --batch 32 --out $OUT
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPE_MEDIUM, SHAPE_SMALL, random_weights, save_json, write_config  # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from hybrid_engine.step import runner as runner_mod  # noqa: E402
from hybrid_engine.step import transfer as transfer_mod  # noqa: E402


def _decode_only(sched) -> bool:
    return all(r.is_decode for r in sched.rows)


def measure(model_dir, batch, steps, async_scheduling, spec, enforce_eager):
    with random_weights():
        llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_seqs=batch, async_scheduling=async_scheduling,
                  speculative_config=spec, enforce_eager=enforce_eager, enable_prefix_caching=False)
    eng = llm.engine
    marks, fwd_marks, waits = [], [], []
    orig = runner_mod.ModelRunner.execute
    orig_fwd = type(eng.runner.executor).forward
    orig_wait = transfer_mod.D2HCopy.wait

    # events made up front: creating timing events per step would add host time to the very
    # steps whose host time the gap measures
    def ev_pool():
        return [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(steps + 16)]
    pool, fwd_pool = ev_pool(), ev_pool()

    def execute(self, sched):
        start, end = pool[len(marks) % len(pool)]
        start.record()
        handle = orig(self, sched)
        end.record()
        marks.append((start, end, sched))            # decode-only is checked after the run
        return handle

    def forward(self, fb):                             # GPU span of the forward (graph replay) alone
        start, end = fwd_pool[len(fwd_marks) % len(fwd_pool)]
        start.record()
        out = orig_fwd(self, fb)
        end.record()
        fwd_marks.append((start, end))
        return out

    def wait(self):                                    # host time blocked on a step's output
        t0 = time.perf_counter()
        try:
            return orig_wait(self)
        finally:
            waits.append(time.perf_counter() - t0)
    gg = getattr(eng.runner, "greedy_graphs", None)   # greedy steps replay prepare + forward + argmax there
    orig_gg = type(gg).replay if gg is not None else None

    def greedy_replay(self, *a, **k):                  # the greedy graph plan's one replay
        start, end = fwd_pool[len(fwd_marks) % len(fwd_pool)]
        start.record()
        out = orig_gg(self, *a, **k)
        end.record()
        fwd_marks.append((start, end))
        return out
    runner_mod.ModelRunner.execute = execute
    type(eng.runner.executor).forward = forward
    if gg is not None:
        type(gg).replay = greedy_replay
    transfer_mod.D2HCopy.wait = wait
    try:
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=steps + 40, ignore_eos=True)
        for _ in range(batch):
            eng.add_request(eng.make_request(rng.integers(3, 1000, 32).tolist(), params))
        for _ in range(10):                               # prefill + warm-up
            eng.step()
        marks.clear()
        fwd_marks.clear()
        waits.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        runner_mod.ModelRunner.execute = orig
        type(eng.runner.executor).forward = orig_fwd
        if gg is not None:
            type(gg).replay = orig_gg
        transfer_mod.D2HCopy.wait = orig_wait
    gaps = [marks[i][1].elapsed_time(marks[i + 1][0]) * 1e3 for i in range(len(marks) - 1)
            if _decode_only(marks[i][2]) and _decode_only(marks[i + 1][2])]          # microseconds, decode-only steps
    busy = [s.elapsed_time(e) * 1e3 for s, e, _ in marks]
    fwd = [s.elapsed_time(e) * 1e3 for s, e in fwd_marks]
    step_us = wall / steps * 1e6
    wait_us = sum(waits) / steps * 1e6
    return dict(async_scheduling=async_scheduling, graphs=not enforce_eager, batch=batch, steps=steps,
                step_us=step_us, gpu_step_us=statistics.median(busy), fwd_gpu_us=statistics.median(fwd),
                host_wait_us=wait_us, host_busy_us=step_us - wait_us,
                gap_median_us=statistics.median(gaps), gap_p90_us=float(np.percentile(gaps, 90)),
                gap_max_us=max(gaps))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--shape", choices=["small", "medium"], default="small")
    ap.add_argument("--graphs-only", action="store_true")
    ap.add_argument("--greedy-only", action="store_true", help="skip the n-gram rows")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    shape = SHAPE_SMALL if args.shape == "small" else SHAPE_MEDIUM
    model_dir = write_config(Path(tempfile.mkdtemp()) / args.shape, shape)
    rows = []
    for spec in ((None,) if args.greedy_only else (None, SpeculativeConfig("ngram", 3))):
        for eager in ((False,) if args.graphs_only else (False, True)):
            for asy in (True, False):
                r = measure(model_dir, args.batch, args.steps, asy, spec, eager)
                r["spec"] = "ngram K=3" if spec else "none"
                r["shape"] = args.shape
                rows.append(r)
                print(r, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / f"async-gap-{args.shape}.json", dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  command=" ".join(sys.argv), rows=rows))
    print("\n| spec | graphs | async | wall step us | host busy us | host wait us | GPU step span us "
          "| GPU forward us | gap median us | gap p90 us |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['spec']} | {r['graphs']} | {r['async_scheduling']} | {r['step_us']:.0f} | {r['host_busy_us']:.0f} "
              f"| {r['host_wait_us']:.0f} | {r['gpu_step_us']:.0f} | {r['fwd_gpu_us']:.0f} "
              f"| {r['gap_median_us']:.1f} | {r['gap_p90_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
