"""Host work per engine step outside the model forward: wall time and torch ops dispatched.

A tiny model (hidden 64, vocab 32000 so sampling over the vocab costs what it does on a real model)
keeps the forward small; batch-32 decode runs in three variants (greedy, greedy + ngram K=3, seeded
top-p sampling). Per decode step it reports (medians over the measured steps):

- step ms: wall time of ``engine.step()``;
- fwd ms: time inside the forward executor (CPU: the forward's compute; CUDA: graph input copies +
  replay launch), wait ms: time inside the D2H wait (the step's one designated sync);
- host ms = step - fwd - wait: everything else (scheduler, batch update, input preparation,
  sampling / rejection, drafter, commit). On CPU this includes the sampler's arithmetic over the
  vocab; on CUDA it is launch and Python overhead only;
- ops: aten ops dispatched per step outside the forward executor (a TorchDispatchMode counting
  every op, paused inside ``executor.forward``); fwd ops: those inside it (on CUDA with graphs: the
  copies into the static buffers; the replay itself dispatches nothing).

    python benchmarks/host_overhead.py                      # CPU, < 1 minute
    python benchmarks/host_overhead.py --device cuda        # same on a GPU (CUDA graphs on)
    python benchmarks/host_overhead.py --profile greedy     # + cProfile top 25 by cumulative time
"""
from __future__ import annotations

import argparse
import cProfile
import collections
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPE_SMALL, random_weights, write_config  # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from hybrid_engine.step import transfer as transfer_mod  # noqa: E402

SHAPE_TINY = dict(pattern="M-M*-", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                  vocab_size=32000)


class OpCounter(TorchDispatchMode):
    """Counts aten ops by name while ``counting`` is True (the forward executor turns it off)."""

    def __init__(self):
        super().__init__()
        self.counting = True
        self.counts: collections.Counter = collections.Counter()
        self.fwd_counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.counts if self.counting else self.fwd_counts)[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Probes:
    """Times (and pauses op counting in) the forward executor and the D2H wait of one engine."""

    def __init__(self, engine):
        self.fwd_s = 0.0
        self.wait_s = 0.0
        self.counter: OpCounter | None = None
        ex = engine.runner.executor
        orig_fwd = ex.forward

        def forward(fb):
            c = self.counter
            if c is not None:
                c.counting = False
            t0 = time.perf_counter()
            try:
                return orig_fwd(fb)
            finally:
                if engine.cfg.device.type == "cuda":
                    pass                                   # launch cost only: no sync here
                self.fwd_s += time.perf_counter() - t0
                if c is not None:
                    c.counting = True
        ex.forward = forward
        orig_wait = transfer_mod.D2HCopy.wait
        probes = self

        def wait(copy):
            t0 = time.perf_counter()
            try:
                return orig_wait(copy)
            finally:
                probes.wait_s += time.perf_counter() - t0
        self._orig_wait = orig_wait
        transfer_mod.D2HCopy.wait = wait

    def close(self) -> None:
        transfer_mod.D2HCopy.wait = self._orig_wait


class PhaseTimer:
    """Inclusive wall time per step of selected methods (``--phases``): wraps each with two
    perf_counter calls (~0.2 us), so unlike cProfile it barely perturbs what it measures."""

    # the step's phases (docs/design.md, "The step as phases") and the calls inside them
    PHASES = [("scheduling.scheduler", "Scheduler.schedule"), ("scheduling.scheduler", "Scheduler.update_from_output"),
              ("step.runner", "ModelRunner._update_batch"), ("step.runner", "ModelRunner._choose_plan"),
              ("step.plans.mixed", "MixedPlan.prepare"), ("step.plans.decode_only", "DecodeOnlyPlan.prepare"),
              ("step.decode_prep", "prepare_decode"), ("step.transfer", "H2D.put_raw"), ("step.transfer", "H2D.put"),
              ("step.graphs", "CudaGraphExecutor.forward"), ("step.sample", "TokenSampler.sample"),
              ("step.sample", "DraftVerifier.sample"), ("step.runner", "ModelRunner._draft_context"),
              ("step.transfer", "D2H.copy"), ("step.runner", "ModelRunner.execute"), ("step.transfer", "D2HCopy.wait"),
              ("step.step_io", "StepHandle._output"), ("step.input_batch", "InputBatch.append_placeholders"),
              ("engine", "EngineCore.launch"), ("engine", "EngineCore.finish_step"),
              ("step.greedy_graphs", "GreedyStepGraphs.applies"), ("step.greedy_graphs", "GreedyStepGraphs.replay"),
              ("step.spec_graphs", "SpecStepGraphs.applies"), ("step.spec_graphs", "SpecStepGraphs.replay"),
              ("step.runner", "ModelRunner._finish_fused"), ("step.runner", "ModelRunner._finish")]
    IMPORTERS = ("step.plans.decode_only",)     # modules that import a patched module function by name

    def __init__(self):
        import importlib
        self.acc = collections.defaultdict(float)
        self._undo = []
        for mod_name, qual in self.PHASES:
            mod = importlib.import_module(f"hybrid_engine.{mod_name}")
            owner_name, _, attr = qual.rpartition(".")
            owner = getattr(mod, owner_name) if owner_name else mod
            orig = getattr(owner, attr)
            self._undo.append((owner, attr, orig))
            setattr(owner, attr, self._wrap(qual, orig))
            if not owner_name:                       # module function: patch its importers too
                for other in self.IMPORTERS:
                    m2 = importlib.import_module(f"hybrid_engine.{other}")
                    if getattr(m2, attr, None) is orig:
                        self._undo.append((m2, attr, orig))
                        setattr(m2, attr, self._wrap(qual, orig))

    def _wrap(self, name, fn):
        acc, pc = self.acc, time.perf_counter

        def wrapped(*a, **kw):
            t0 = pc()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] += pc() - t0
        return wrapped

    def close(self):
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)


VARIANTS = {
    "greedy": (None, lambda i: dict(temperature=0.0)),
    # adaptive (the default): on random weights it soon verifies no drafts; fixed: every step K = 3
    "ngram3": (lambda: SpeculativeConfig("ngram", 3), lambda i: dict(temperature=0.0)),
    "ngram3fixed": (lambda: SpeculativeConfig("ngram", 3, adaptive=False), lambda i: dict(temperature=0.0)),
    "sampled": (None, lambda i: dict(temperature=0.8, top_p=0.95, seed=1000 + i)),
}


def run_variant(name, model_dir, args, dtype):
    spec_fn, params_fn = VARIANTS[name]
    k = 3 if spec_fn else 0
    # every loop below (warm-up, timed, counted, phases, profile) must find every request still
    # decoding: a loop over finished requests would time empty steps
    steps = args.warmup + 3 * args.steps + args.count_steps
    max_tokens = (1 + k) * steps + 64
    with random_weights():
        llm = LLM(model_dir, dtype=dtype, device=args.device, max_num_seqs=args.batch,
                  speculative_config=spec_fn() if spec_fn else None, async_scheduling=not args.sync,
                  max_model_len=args.prompt_len + max_tokens + 16, enable_prefix_caching=False)
    eng = llm.engine
    rng = np.random.default_rng(0)
    for i in range(args.batch):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params_fn(i))
        eng.add_request(eng.make_request(rng.integers(3, 1000, args.prompt_len).tolist(), params))
    probes = Probes(eng)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    try:
        for _ in range(args.warmup):                   # prefill (one step) + warm-up decode steps
            eng.step()
        sync()
        rows = []
        for _ in range(args.steps):
            probes.fwd_s = probes.wait_s = 0.0
            t0 = time.perf_counter()
            eng.step()
            rows.append((time.perf_counter() - t0, probes.fwd_s, probes.wait_s))
        sync()
        counts, fwd_counts = [], []
        for _ in range(args.count_steps):
            probes.counter = OpCounter()
            with probes.counter:
                eng.step()
            counts.append(probes.counter.counts)
            fwd_counts.append(probes.counter.fwd_counts)
            probes.counter = None
        phases = None
        if args.phases:
            timer = PhaseTimer()
            try:
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    eng.step()
                phases = {k: v / args.steps * 1e6 for k, v in timer.acc.items()}
                phases["step (all)"] = (time.perf_counter() - t0) / args.steps * 1e6
            finally:
                timer.close()
        prof = None
        if args.profile in (name, "all"):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                eng.step()
            prof.disable()
    finally:
        probes.close()
    med = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    step_ms = med([r[0] for r in rows])
    fwd_ms = med([r[1] for r in rows])
    wait_ms = med([r[2] for r in rows])
    host_ms = med([r[0] - r[1] - r[2] for r in rows])
    ops = statistics.median(sum(c.values()) for c in counts)
    fwd_ops = statistics.median(sum(c.values()) for c in fwd_counts)
    total = collections.Counter()
    for c in counts:
        total.update(c)
    return dict(variant=name, step_ms=step_ms, fwd_ms=fwd_ms, wait_ms=wait_ms, host_ms=host_ms, ops=ops,
                fwd_ops=fwd_ops, top_ops=[(op, n / len(counts)) for op, n in total.most_common(args.top_ops)],
                prof=prof, phases=phases)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--count-steps", type=int, default=3, help="steps run under the op counter")
    ap.add_argument("--variants", default="greedy,ngram3,ngram3fixed,sampled")
    ap.add_argument("--sync", action="store_true", help="async_scheduling=False")
    ap.add_argument("--top-ops", type=int, default=0, help="print the N most frequent ops per variant")
    ap.add_argument("--profile", default="", help="cProfile top 25 for this variant (or 'all')")
    ap.add_argument("--phases", action="store_true", help="mean us per step inside selected methods")
    ap.add_argument("--shape", choices=["tiny", "small"], default="tiny",
                    help="tiny (default) or the small e2e shape (benchmarks.common.SHAPE_SMALL)")
    ap.add_argument("--pattern", default="", help="layer pattern override (e.g. the 52 layers of the 8B shape, "
                    "to see host work that grows with depth)")
    ap.add_argument("--sort", default="cumulative", choices=["cumulative", "tottime"], help="cProfile order")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    shape = SHAPE_TINY if args.shape == "tiny" else SHAPE_SMALL
    if args.pattern:
        shape = dict(shape, pattern=args.pattern)
    model_dir = write_config(Path(tempfile.mkdtemp()) / args.shape, shape)
    results = [run_variant(v, model_dir, args, dtype) for v in args.variants.split(",")]
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"\nhost overhead per decode step: batch {args.batch}, {dev}, torch {torch.__version__}, "
          f"async={not args.sync}, medians of {args.steps} steps ({args.count_steps} counted)")
    print("| variant | step ms | fwd ms | wait ms | host ms | ops outside fwd | fwd ops |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['step_ms']:.2f} | {r['fwd_ms']:.2f} | {r['wait_ms']:.2f} | "
              f"{r['host_ms']:.2f} | {r['ops']:.0f} | {r['fwd_ops']:.0f} |")
    for r in results:
        if r["top_ops"]:
            print(f"\n{r['variant']}: most frequent ops per step: "
                  + ", ".join(f"{op} {n:.0f}" for op, n in r["top_ops"]))
        if r.get("phases"):
            print(f"\n{r['variant']}: mean us per step inside (inclusive; nested calls overlap):")
            for k, v in sorted(r["phases"].items(), key=lambda kv: -kv[1]):
                print(f"    {k:40s} {v:8.1f}")
        if r["prof"] is not None:
            print(f"\ncProfile, {r['variant']}, {args.steps} steps, top 25 by {args.sort}:")
            pstats.Stats(r["prof"]).sort_stats(args.sort).print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
