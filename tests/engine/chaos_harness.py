"""Fault injection for the chaos tests (test_chaos.py): wraps one engine's step phases so that an
armed phase raises ``InjectedFault`` the next time it runs, and drives ``EngineCore`` through a
workload of requests that arrive at given steps.

Phases, in step order: schedule (Scheduler.schedule), update_batch (runner._update_batch: steps
where rows join or leave), prepare (input preparation), forward (the executor), sample, draft
(the drafter's propose; NoDrafter's too), d2h (the copy of the step's payload), read (unpacking
the copied payload: StepHandle._output, shared by LLM and AsyncLLM), commit
(Scheduler.update_from_output) and output (EngineCore.make_output).
"""
from __future__ import annotations

import numpy as np

from async_harness import forward_targets
from hybrid_engine.llm import _output
from hybrid_engine.sampling_params import SamplingParams
from hybrid_engine.step import step_io

PHASES = ("schedule", "update_batch", "prepare", "forward", "sample", "draft", "d2h", "read", "commit", "output")


class InjectedFault(RuntimeError):
    pass


class Injector:
    """``arm(phase)``: the next call of that phase raises InjectedFault("<phase>#<k>"). ``fired``:
    per fault k, (phase, ids of the requests that were only waiting when it fired)."""

    def __init__(self, eng, monkeypatch):
        self.eng, self.armed = eng, None
        self.fired: list[tuple[str, set[str]]] = []
        r, s = eng.runner, eng.scheduler
        targets = {"schedule": [(s, "schedule")], "update_batch": [(r, "_update_batch")],
                   # every non-fused plan's input preparation (greedy graphs fuse prepare+forward+sample)
                   "prepare": [(p, "prepare") for p in r.plans if not p.fused], "forward": forward_targets(r),
                   "sample": [(r.sampler, "sample")], "draft": [(r.drafter, "propose")], "d2h": [(r.d2h, "copy")],
                   "commit": [(s, "update_from_output")], "output": [(eng, "make_output")]}
        for phase, places in targets.items():
            for obj, name in places:
                monkeypatch.setattr(obj, name, self._wrap(phase, getattr(obj, name)))
        orig_output = step_io.StepHandle._output
        injector = self

        def read(handle, host):
            injector._maybe_fire("read")
            return orig_output(handle, host)
        monkeypatch.setattr(step_io.StepHandle, "_output", read)

    def _wrap(self, phase, fn):
        def wrapped(*a, **k):
            self._maybe_fire(phase)
            return fn(*a, **k)
        return wrapped

    def _maybe_fire(self, phase):
        if self.armed != phase:
            return
        self.armed = None
        waiting = {q.request_id for q in self.eng.scheduler.waiting if q.metrics.num_preemptions == 0}
        self.fired.append((phase, waiting))
        raise InjectedFault(f"{phase}#{len(self.fired) - 1}")

    def arm(self, phase: str) -> None:
        self.armed = phase


def make_workload(rng: np.random.Generator, n: int, *, sampled: bool, prefix: str):
    """n requests: (arrival step, prompt, params, request id). ``sampled``: some rows sample with
    a seed (batch invariant), else all greedy."""
    items = []
    for i in range(n):
        prompt = rng.integers(3, 256, int(rng.integers(1, 17))).tolist()
        kw = dict(max_tokens=int(rng.integers(1, 7)), ignore_eos=bool(rng.random() < 0.7))
        if sampled and rng.random() < 0.5:
            kw.update(temperature=float(rng.choice([0.5, 1.0])), seed=int(rng.integers(0, 2**31)),
                      top_k=int(rng.choice([-1, 5])))
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [int(t) for t in rng.integers(3, 256, 2)]
        items.append((int(rng.integers(0, 6)), prompt, SamplingParams(**kw), f"{prefix}-{i}"))
    return items


def drive(eng, workload, injector: Injector | None = None, plan: dict[int, str] | None = None):
    """Run the workload step by step (arrivals by step index; ``plan``: step index -> phase to arm
    before that step) -> {request id: RequestOutput}. Finished requests are forgotten."""
    pending = sorted(workload, key=lambda w: w[0])
    reqs, step = {}, 0
    while pending or eng.has_work():
        while pending and pending[0][0] <= step:
            _, prompt, params, rid = pending.pop(0)
            req = eng.make_request(prompt, params, rid)
            eng.add_request(req)
            reqs[rid] = req
        if injector is not None and plan and step in plan:
            injector.arm(plan[step])
        eng.step()
        step += 1
        assert step < 2000, "the engine stopped making progress"
    outs = {rid: _output(eng, r) for rid, r in reqs.items()}
    if injector is not None:
        injector.armed = None
    for rid in reqs:
        eng.scheduler.pop_finished(rid)
    return outs


def assert_idle_and_clean(eng):
    """Nothing leaks: every slot and KV block free, no request left, no step in flight, and every
    row still in the input batch queued for removal at the next step."""
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"], st
    assert st["free_blocks"] == st["total_blocks"], st
    assert not eng.scheduler.requests and not eng.scheduler.has_unfinished()
    assert eng._inflight is None
    assert set(eng.runner.batch.req_id_to_row) <= eng.scheduler._removed
