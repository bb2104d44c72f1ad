"""Profiler readings for the benchmarks: kernel times by name and by kind (torch profiler CUDA
events), the kernels of one prefill, and where the GPU idles during one generate with the host
work that overlapped each idle stretch."""
from __future__ import annotations

import re

import torch


KERNEL_KINDS = (("nccl", ("nccl",)), ("all-reduce + norm (fused)", ("allreduce",)), ("state update (SSU)", ("_ssu",)),
                ("linear / GEMV", ("linear", "gemv", "nvjet", "gemm", "cutlass", "splitk")),
                ("norm", ("norm",)), ("conv", ("conv",)), ("attention", ("attn",)),
                ("argmax / sampling", ("argmax", "reduce", "sample", "topk")))


def kernel_breakdown(prof, steps: int) -> dict:
    """GPU ms per decode step by kernel kind (kernels replayed from CUDA graphs included)."""
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), "other")
        out[kind] = out.get(kind, 0.0) + e.device_time_total / 1e3 / steps
    out["total"] = sum(out.values())
    return {k: round(v, 4) for k, v in sorted(out.items(), key=lambda kv: -kv[1])}


def kernel_times(prof, width: int = 80) -> list[tuple[str, int, float]]:
    """[(kernel name cut to ``width``, launches, GPU ms)] of a torch profiler's CUDA events (kernels
    replayed from CUDA graphs included), costliest first."""
    acc: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            row = acc.setdefault(e.name[:width], [0, 0.0])
            row[0] += 1
            row[1] += e.device_time_total / 1e3
    return sorted(((n, c, ms) for n, (c, ms) in acc.items()), key=lambda r: -r[2])


def idle_gaps(busy, start: float, end: float, min_us: float = 20.0) -> list[tuple[float, float]]:
    """The stretches of [start, end] (us) that no (s, e) interval of ``busy`` covers, each at least
    ``min_us`` long, in time order: where the GPU had no kernel or copy running."""
    gaps, t = [], start
    for s, e in sorted((max(s, start), min(e, end)) for s, e in busy if e > start and s < end):
        if s > t and s - t >= min_us:
            gaps.append((t, s))
        t = max(t, e)
    if end > t and end - t >= min_us:
        gaps.append((t, end))
    return gaps


_OUR_CODE = ("hybrid_engine/", "mamba_cache/", "spec/")
_FRAME = re.compile(r"\(\d+\): ")          # a Python frame event's name: "path(line): function"


def _overlaps(events, gs: float, ge: float, longest: float | None = None) -> dict[str, float]:
    """name -> us of [gs, ge] that ``events`` (``.name``, ``.time_range``) overlap, summed; only
    events at most ``longest`` us long when given."""
    over: dict[str, float] = {}
    for e in events:
        if longest is not None and e.time_range.end - e.time_range.start > longest:
            continue
        o = min(e.time_range.end, ge) - max(e.time_range.start, gs)
        if o > 0:
            over[e.name] = over.get(e.name, 0.0) + o
    return over


def gap_rows(host_ops, our_frames, gaps, top: int = 10, names: int = 4) -> list[dict]:
    """The ``top`` longest ``gaps`` [(start, end) us], each with the host work that overlapped it,
    longest overlap first (up to ``names`` each): ``host`` the host ops (aten ops, CUDA runtime
    calls, module ranges; events with ``.name`` and ``.time_range.start`` / ``.end`` in us), and
    ``ours`` the Python frames of this repository (profiler events named "path(line): function")
    at most 4x the gap long: the innermost code that ran then (the frames that enclose the whole
    step are longer and left out)."""
    rows = []
    for gs, ge in sorted(gaps, key=lambda g: g[0] - g[1])[:top]:
        def best(over):
            return [f"{k} ({v:.0f} us)" for k, v in sorted(over.items(), key=lambda kv: -kv[1])[:names]]
        rows.append(dict(start_us=gs, us=ge - gs, host=best(_overlaps(host_ops, gs, ge)),
                         ours=best(_overlaps(our_frames, gs, ge, longest=4 * (ge - gs)))))
    return rows


def prefill_gaps(llm, prompt, params, top: int = 10, min_us: float = 20.0) -> dict:
    """Where the GPU idles during one ``llm.generate([prompt], params)``: a torch profiler trace
    with CPU events and Python stacks; the wall time of the call, the GPU's busy time (kernels and
    copies, merged), its idle stretches of at least ``min_us``, and the ``top`` longest with the
    host work that overlapped each (``gap_rows``). The profiler's own CPU overhead lengthens host
    work, so the gaps are upper bounds; it answers where, not how much."""
    from torch.profiler import ProfilerActivity, profile, record_function
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, with_stack=True) as prof:
        with record_function("prefill_gaps.generate"):
            llm.generate([prompt], params, use_tqdm=False)
            if cuda:
                torch.cuda.synchronize()
    events = prof.events()
    span = next(e for e in events if e.name == "prefill_gaps.generate").time_range
    device = [(e.time_range.start, e.time_range.end) for e in events
              if e.device_type == torch.autograd.DeviceType.CUDA]
    idle_all = idle_gaps(device, span.start, span.end, 0.0)
    gaps = [(s, e) for s, e in idle_all if e - s >= min_us]
    # with_stack makes each Python frame an event too ("path(line): function"): host ops are the rest
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name != "prefill_gaps.generate"]
    frames = [e for e in cpu if _FRAME.search(e.name)]
    host_ops = [e for e in cpu if not _FRAME.search(e.name) and not e.name.startswith("<built-in")]
    ours = [e for e in frames if any(p in e.name for p in _OUR_CODE)]
    out = dict(wall_ms=(span.end - span.start) / 1e3, idle_ms=sum(e - s for s, e in idle_all) / 1e3,
               idle_in_gaps_ms=sum(e - s for s, e in gaps) / 1e3, min_gap_us=min_us, gaps=len(gaps),
               longest=gap_rows(host_ops, ours, gaps, top))
    for r in out["longest"]:
        r["at_ms"] = (r.pop("start_us") - span.start) / 1e3
    print(f"prefill {len(prompt)} gaps: wall {out['wall_ms']:.2f} ms, GPU idle {out['idle_ms']:.2f} ms "
          f"({out['gaps']} gaps >= {min_us:.0f} us: {out['idle_in_gaps_ms']:.2f} ms)", flush=True)
    for r in out["longest"]:
        print(f"  at {r['at_ms']:7.2f} ms: {r['us']:7.1f} us idle; host: {'; '.join(r['host'])}; ours: "
              f"{'; '.join(r['ours'])}", flush=True)
    return out


def profile_prefill(llm, prompt, params, top: int = 30) -> list[dict]:
    """GPU time by kernel of one ``llm.generate([prompt], params)`` (a prefill with max_tokens=1;
    torch profiler; run with HYBRID_ENGINE_PDL=0 for kernel times that do not include a dependent
    launch's wait): [{name, calls, ms}] of the ``top`` costliest kernels, printed after the GPU
    busy total (benchmarks/moe.py, benchmarks/quant_prefill_profile.py)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params, use_tqdm=False)
        torch.cuda.synchronize()
    times = kernel_times(prof, 70)
    print(f"prefill {len(prompt)} profile: GPU busy {sum(ms for _, _, ms in times):.2f} ms", flush=True)
    rows = [dict(name=n, calls=c, ms=ms) for n, c, ms in times[:top]]
    for r in rows:
        print(f"  {r['ms']:8.3f} ms {r['calls']:5d}x {r['name']}", flush=True)
    return rows
