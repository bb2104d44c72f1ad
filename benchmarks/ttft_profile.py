"""Where a cached-prefix TTFT goes on the 8B shape (issue 19): a 2048-token system prompt computed
once, then requests of system + 300 new tokens, max_tokens=1, prefix caching on, one at a time.
Per request: wall ms of each engine.step; for one more request a torch profiler trace: CUDA kernel
launches, GPU busy time, aten ops, the top host-side ops by self CPU time and the top kernels.

    python benchmarks/ttft_profile.py          # CUDA, ~30 s
    python benchmarks/ttft_profile.py --requests 12 --uncached 4   # medians; uncached TTFT beside

With --uncached N it also times N requests of as many fresh tokens (no shared prefix), so the
cached/uncached TTFT ratio (the issue's 5x goal) comes from one run on one machine.
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import random_weights  # noqa: E402
from benchmarks.profiling import kernel_times  # noqa: E402
from benchmarks.prefix_cache import make_model_dir  # noqa: E402
from hybrid_engine import LLM, SamplingParams  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--requests", type=int, default=4, help="cached-prefix requests timed before the profiled one")
ap.add_argument("--uncached", type=int, default=0, help="also time this many requests with no shared prefix")
ap.add_argument("--phases", action="store_true",
                help="print where each cached request's first step spends its host time (schedule, "
                     "prepare up to the forward, the forward's host part)")
ap.add_argument("--cprofile", action="store_true", help="also a cProfile of one more cached request's steps")
ap.add_argument("--no-prefill-graphs", action="store_true", help="prefill_cuda_graphs=False (the eager prefill)")
args = ap.parse_args()
root = Path(tempfile.mkdtemp())
md = make_model_dir("8b", root)
with random_weights():
    llm = LLM(str(md), dtype="bfloat16", device="cuda", max_num_seqs=32, max_num_batched_tokens=8192,
              enable_prefix_caching=True, mamba_checkpoint_interval=64, mamba_checkpoint_bytes=12 << 30,
              kv_cache_memory_fraction=0.5, **({"prefill_cuda_graphs": False} if args.no_prefill_graphs else {}))
eng = llm.engine
rng = np.random.default_rng(0)
V = eng.cfg.model.vocab_size
system = rng.integers(3, V, 2048).tolist()
sp = SamplingParams(max_tokens=1, ignore_eos=True)
llm.generate([[5] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def one(i, prof=None, shared=True):
    user = rng.integers(3, V, 300).tolist()
    prompt = system + user if shared else rng.integers(3, V, len(system) + len(user)).tolist()
    req = eng.make_request(prompt, sp, f"s{i}" if shared else f"u{i}")
    eng.add_request(req)
    steps = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.has_work():
        ts = time.perf_counter()
        for r in eng.step():
            if r.finished:
                eng.forget(r)
        steps.append((time.perf_counter() - ts) * 1e3)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, steps, req


_marks: list[tuple[str, float]] = []


def _timed(name, fn):
    def wrapper(*a, **kw):
        _marks.append((name + ">", time.perf_counter()))
        try:
            return fn(*a, **kw)
        finally:
            _marks.append((name + "<", time.perf_counter()))
    return wrapper


_inside: dict[str, float] = {}


def _summed(name, fn):
    """Adds the inclusive ms of each call to _inside[name] (the finer breakdown of --phases)."""
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            _inside[name] = _inside.get(name, 0.0) + (time.perf_counter() - t) * 1e3
    return wrapper


if args.phases:          # instance attributes shadow the methods: only this engine is timed
    eng.launch = _timed("launch", eng.launch)
    eng.scheduler.schedule = _timed("schedule", eng.scheduler.schedule)
    eng.runner.executor.forward = _timed("forward", eng.runner.executor.forward)
    run, sch = eng.runner, eng.scheduler
    for obj, attr in ((sch.prefix, "match"), (sch.prefix, "hashes"), (sch.prefix, "plan_chunk"),
                      (sch.prefix, "begin_step"), (sch.blocks, "lookup"), (run, "_update_batch"),
                      (run.h2d, "put"), (run.sampler, "sample"), (run, "_finish"), (run, "_d2h_payload"),
                      (run, "_advance"), (run, "_nonfinite_step_rows"), (run.drafter, "propose")):
        setattr(obj, attr, _summed(f"{type(obj).__name__}.{attr}", getattr(obj, attr)))
    for plan in (p for p in run.plans if hasattr(p, "prepare")):
        plan.prepare = _summed(f"{type(plan).__name__}.prepare", plan.prepare)


def phases_ms() -> str:
    """The first launch's phases, ms from its start: schedule, forward entry, forward exit, end."""
    t = {}
    for name, at in _marks:
        t.setdefault(name, at)               # the first occurrence of each mark: the first step
    if "launch>" not in t:
        return ""
    z = t["launch>"]
    return ("; first launch ms: schedule {:.2f}-{:.2f}, forward {:.2f}-{:.2f}, end {:.2f}".format(
        *((t[k] - z) * 1e3 for k in ("schedule>", "schedule<", "forward>", "forward<", "launch<")))
        + "\n    inside (ms, both steps): " + ", ".join(f"{k} {v:.3f}" for k, v in _inside.items()))


def ttft_ms(req):
    return 1e3 * (req.metrics.first_token_time - req.metrics.arrival_time)


cached_ttft = []
for i in range(args.requests):
    _marks.clear()
    _inside.clear()
    wall, steps, req = one(i)
    print(f"req {i}: wall {wall:.1f} ms, steps {[round(s, 1) for s in steps]}, cached {req.num_cached_tokens}, "
          f"ttft {ttft_ms(req):.1f} ms{phases_ms()}", flush=True)
    if i >= 2:  # request 0 computes the prefix, request 1 is the first restore (compiles)
        cached_ttft.append(ttft_ms(req))
uncached_ttft = []
for i in range(args.uncached):
    wall, steps, req = one(i, shared=False)
    print(f"uncached {i}: wall {wall:.1f} ms, steps {[round(s, 1) for s in steps]}, cached {req.num_cached_tokens}, "
          f"ttft {ttft_ms(req):.1f} ms", flush=True)
    if i >= 1:
        uncached_ttft.append(ttft_ms(req))
if cached_ttft:
    print(f"cached TTFT median {np.median(cached_ttft):.1f} ms over {len(cached_ttft)} requests")
if uncached_ttft:
    print(f"uncached TTFT median {np.median(uncached_ttft):.1f} ms over {len(uncached_ttft)} requests; "
          f"ratio {np.median(uncached_ttft) / np.median(cached_ttft):.2f}x")
if args.cprofile:                      # where the host time before the GPU starts goes (Python level)
    import cProfile
    import pstats
    cp = cProfile.Profile()
    cp.enable()
    wall, steps, req = one(98)
    cp.disable()
    print(f"cProfiled: wall {wall:.1f} ms, steps {[round(s, 1) for s in steps]}")
    pstats.Stats(cp).sort_stats("tottime").print_stats(30)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    wall, steps, req = one(99)
print(f"profiled: wall {wall:.1f} ms, steps {[round(s, 1) for s in steps]}, cached {req.num_cached_tokens}")
ev = prof.events()
gpu = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
print(f"GPU kernels {len(gpu)}, GPU busy {sum(e.device_time_total for e in gpu) / 1e3:.2f} ms")
launches = [e for e in ev if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")]
print(f"launch API calls {len(launches)}: " + ", ".join(f"{n} {sum(1 for e in launches if e.name == n)}" for n in {e.name for e in launches}))
aten = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")]
print(f"aten ops (incl. nested) {len(aten)}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
for n, c, t in kernel_times(prof, 50)[:40]:
    print(f"{t:8.2f} ms {c:5d}x {n}")
