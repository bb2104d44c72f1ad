"""Shared benchmark plumbing: model shapes, random weights without a checkpoint, timing."""
from __future__ import annotations

import contextlib
import json
import statistics
import time
import weakref
from pathlib import Path

import numpy as np
import torch

SHAPE_8B = dict(pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")  # NemotronHConfig defaults
SHAPE_SMALL = dict(pattern="M-M*-M-M*-", hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                   head_dim=64, intermediate_size=1024, mamba_num_heads=16, mamba_head_dim=64, n_groups=2,
                   ssm_state_size=64, vocab_size=32000)

SHAPE_MEDIUM = dict(pattern="M-M-M*-M-M-M*-M-M-M*-", hidden_size=2048, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=128, intermediate_size=8192, mamba_num_heads=64,
                    mamba_head_dim=64, n_groups=8, ssm_state_size=128, vocab_size=32000)


def write_config(out_dir: Path, shape: dict) -> Path:
    from hybrid_engine.models.synthetic import hf_config
    kw = dict(shape)
    cfg = hf_config(kw.pop("pattern"), **kw)
    cfg.torch_dtype = "bfloat16"
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out_dir)
    return out_dir


@contextlib.contextmanager
def random_weights(std: float = 0.02):
    """Build models with random weights instead of reading a checkpoint (benchmarks only)."""
    import hybrid_engine.models.loader as loader

    def fill(model, model_dir, dtype=None, device=None, *a, **k):
        g = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.rand(p.shape, generator=g, device=p.device).mul(2.7).to(p.dtype))
                elif name.endswith(("norm.weight", "norm_f.weight", "layernorm.weight", ".D")):
                    p.fill_(1.0)
                elif name.endswith("dt_bias"):
                    p.fill_(-2.0)
                else:
                    p.normal_(0.0, std, generator=g)
            for name, b in model.named_buffers():
                b.zero_()
        return model
    orig = loader.load_checkpoint
    loader.load_checkpoint = fill
    try:
        yield
    finally:
        loader.load_checkpoint = orig


def hf_twin(our_model, model_dir: Path):
    """A transformers NemotronH sharing our parameters (no copy): backbone.* -> model.*. Built on
    the meta device and assigned our state dict, so a model that fits the device once still fits
    (the full Nano-30B-A3B shape); a name or shape that does not match, or a tensor left on the
    meta device, is an error: the baseline must run our exact weights."""
    from transformers import AutoConfig, NemotronHForCausalLM
    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        hf = NemotronHForCausalLM(cfg)
    sd = {("model." + k[len("backbone."):] if k.startswith("backbone.") else k): v
          for k, v in our_model.state_dict().items() if not k.startswith("mtp.")}
    hf.load_state_dict(sd, assign=True, strict=True)
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"hf_twin: {len(left)} tensors were not assigned from our model, e.g. {left[0]}")
    return hf.eval()


def hf_greedy_decode(hf, prompts: list[list[int]], gen: int, sync=None, iters: int = 3) -> dict:
    """transformers' greedy ``generate`` of ``gen`` tokens after each of ``prompts`` (one batch,
    equal lengths) on ``hf``'s device: the decode step time is (time of ``gen`` tokens - time of
    one) / (gen - 1), so the prompt's prefill is not counted -> dict(batch, tok_s, step_ms,
    tokens). ``sync`` as in ``median_time`` (``torch.cuda.synchronize`` on CUDA)."""
    ids = torch.tensor(prompts, device=next(hf.parameters()).device)
    last = {}                                # the latest output per length: the tokens, without a rerun

    def run(n):
        with torch.no_grad():
            last[n] = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=0)

    run(2)                                                                   # warm-up
    t1 = median_time(lambda: run(1), warmup=0, iters=iters, sync=sync)
    tn = median_time(lambda: run(gen), warmup=0, iters=iters, sync=sync)
    step = max(tn - t1, 1e-9) / (gen - 1)
    return dict(batch=len(prompts), tok_s=len(prompts) / step, step_ms=step * 1e3,
                tokens=last[gen][:, ids.shape[1]:].tolist())


def median_time(fn, *, warmup: int = 1, iters: int = 3, sync=None) -> float:
    """Median wall time of fn() in seconds over ``iters`` calls after ``warmup`` calls; ``sync``
    (e.g. ``torch.cuda.synchronize``; None: nothing to wait for, CPU) runs after the warm-up and
    inside each timed call, so queued device work is counted."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cuda_time(fn, warmup: int = 1, iters: int = 3) -> float:
    """Median wall time of fn() in seconds, synchronised."""
    return median_time(fn, warmup=warmup, iters=iters, sync=torch.cuda.synchronize)


def event_ms(fn, n: int) -> float:
    """GPU time per call in ms of n back-to-back calls of fn, between two CUDA events."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def graph_ms(calls, reps: int = 20, replays: int = 7) -> float:
    """GPU ms per call: ``reps`` calls (cycling through ``calls``, zero-arg callables already warmed
    up) captured in one CUDA graph, median over ``replays`` replays; no Python launch cost."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls[0]()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for k in range(reps):
            calls[k % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    t = statistics.median(event_ms(g.replay, 1) / reps for _ in range(replays))
    del g
    return t


def time_candidates(label: str, cands, weights, ref):
    """A kernel sweep's timing loop: each ``(kind, cfg, fn)`` of ``cands`` is checked once against
    ``ref`` (max abs error over max |ref|) on ``weights[0]``, then timed by ``graph_ms`` over calls
    cycling through ``weights`` (copies beyond L2). Yields ``(kind, cfg, ms, err)``; a config that
    fails to compile or run is printed and skipped."""
    for kind, cfg, fn in cands:
        try:
            err = float((fn(weights[0]).float() - ref).abs().max() / ref.abs().max())
            calls = [lambda w=w, fn=fn: fn(w) for w in weights]
            for c in calls:
                c()
            ms = graph_ms(calls)
        except Exception as exc:  # a config that does not compile: report, go on
            print(f"  {label} {kind} {cfg}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)
            continue
        yield kind, cfg, ms, err


def sweep_header() -> tuple[str, float]:
    """(the header line of a kernel sweep: device, torch, date, copy GB/s; copy bandwidth in GB/s),
    printed; the random seed fixed."""
    torch.manual_seed(0)
    bw = copy_bandwidth() / 1e9
    head = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
            f"copy {bw:.0f} GB/s")
    print(head, flush=True)
    return head, bw


def copy_bandwidth(nbytes: int = 1 << 30, device="cuda", rounds: int = 5) -> float:
    """Measured copy bandwidth on ``device`` in bytes/s (read + write counted): the best of
    ``rounds`` medians of 10 copies, the achievable rate the rooflines divide by. One median of a
    few copies moved by 8% between runs on one machine (3.84 to 4.16 TB/s on an H200, 2026-11-29)
    while the engine's own rates held within 1% (``results/2026-11-29-moe-nano-transformers-h200.md``)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    t = min(median_time(lambda: b.copy_(a), warmup=3 if r == 0 else 0, iters=10, sync=sync) for r in range(rounds))
    del a, b
    return 2 * nbytes / t


def save_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2))


class StepClock:
    """The launch times of an engine's decode-only steps (no prefill rows; rank 0's under tensor
    parallelism): a steady decode step's time is the median interval between consecutive ones.
    (t(n tokens) - t(1 token)) / (n - 1) misleads once a batch's prompts take more than one
    prefill chunk: the two generates split them differently (a mixed chunk with decode rows in
    the long one), so the difference carries part of a prefill, 23-60 ms on the 8B shape. With ``profile=(first, count)`` it also runs the torch
    profiler over decode steps ``first .. first+count-1`` of the next ``run`` (synchronised at both
    ends, so exactly those steps' kernels are caught)."""

    def __init__(self, engine):
        self.times: list[float] = []
        self.profile: tuple[int, int] | None = None
        self.prof = None
        self.profiled_steps = 0
        inner = engine.runner.execute

        def execute(sched):
            if sched.decode is not None and not sched.new_requests and not sched.other_rows:
                self._at_step(len(self.times))
                self.times.append(time.perf_counter())
            return inner(sched)
        engine.runner.execute = execute       # an instance attribute: dropped with the engine

    def _at_step(self, i: int) -> None:
        if self.profile is None:
            return
        first, count = self.profile
        if i == first:
            torch.cuda.synchronize()
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.prof.__enter__()
        elif i == first + count:
            self._stop(count)

    def _stop(self, steps: int) -> None:
        torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.profile, self.profiled_steps = None, steps

    def run(self, fn) -> float:
        """Median seconds between consecutive decode-only step launches during ``fn()`` (a profile
        window still open when ``fn`` returns ends there: ``profiled_steps`` says how many)."""
        self.times = []
        self.prof = None if self.profile is not None else self.prof
        fn()
        if self.profile is not None:
            if self.prof is not None:                  # opened, still open: ends with fn
                self._stop(len(self.times) - self.profile[0])
            else:                                      # never opened: fewer decode steps than its start
                self.profile = None
                raise ValueError(f"profile window never opened: {len(self.times)} decode steps")
        if len(self.times) < 2:
            raise ValueError(f"{len(self.times)} decode-only launches: generate more tokens per row")
        return float(np.median(np.diff(self.times)))

    def step_time(self, fn, runs: int = 3, warmup: int = 1) -> float:
        """A steady decode step's seconds: the median over ``runs`` calls of ``fn`` (a generate of
        several tokens per row) of each call's median launch interval, after ``warmup`` calls."""
        for _ in range(warmup):
            fn()
        return float(np.median([self.run(fn) for _ in range(runs)]))


_CLOCKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class StepTimeline:
    """Every step the runner launches from now on: when ``execute`` began, the plan that took it
    (class name) and how many drafts per row it verified (the previous step's drafts; 0 for a step
    without decode rows, of no speculation, or of resting adaptive rows). ``summary()`` groups the steps by plan and
    width with the median interval from a step's start to the next one's: what a step of that
    kind cost, whichever of the GPU or the host bound it. ``cut()`` marks a boundary (between
    generate calls): no interval spans it."""

    def __init__(self, runner):
        self.steps: list[tuple[float, str, int] | None] = []     # (start, plan, width); None: a cut
        self._plan = "?"
        choose, execute = runner._choose_plan, runner.execute

        def chosen(step):
            plan = choose(step)
            self._plan = type(plan).__name__
            return plan

        def timed(sched):
            prev = runner.prev            # its drafts are what this step's decode rows verify
            width = 0 if sched.decode is None or prev is None or prev.drafts is None else int(prev.drafts.shape[1])
            start = time.perf_counter()
            handle = execute(sched)
            self.steps.append((start, self._plan, width))
            return handle
        runner._choose_plan, runner.execute = chosen, timed

    def clear(self) -> None:
        self.steps.clear()

    def cut(self) -> None:
        self.steps.append(None)

    def steps_by_plan(self, runs: int = 1) -> dict[str, float]:
        """{plan class name: steps per run} (fused step graphs or a general plan), sorted."""
        counts: dict[str, int] = {}
        for s in self.steps:
            if s is not None:
                counts[s[1]] = counts.get(s[1], 0) + 1
        return {name: n / runs for name, n in sorted(counts.items())}

    def summary(self, runs: int = 1) -> dict[str, dict]:
        """{"<plan>/w<width>": {"steps": steps per run, "interval_ms": median}}, sorted by key;
        a step with no next step before a cut has no interval (it counts as a step)."""
        out: dict[str, dict] = {}
        intervals: dict[str, list[float]] = {}
        for cur, nxt in zip(self.steps, self.steps[1:] + [None]):
            if cur is None:
                continue
            key = f"{cur[1]}/w{cur[2]}"
            out.setdefault(key, {"steps": 0})["steps"] += 1
            if nxt is not None:
                intervals.setdefault(key, []).append(nxt[0] - cur[0])
        for key, row in out.items():
            row["steps"] /= runs
            row["interval_ms"] = statistics.median(intervals[key]) * 1e3 if key in intervals else None
        return dict(sorted(out.items()))


def step_clock(llm) -> StepClock:
    """The one ``StepClock`` of ``llm``'s engine (made on first use: wrapping the runner twice
    would count every launch twice)."""
    eng = llm.engine
    if eng not in _CLOCKS:
        _CLOCKS[eng] = StepClock(eng)
    return _CLOCKS[eng]
