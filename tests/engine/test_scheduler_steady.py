"""The scheduler's vectorised steady-decode path (``_schedule_steady`` / ``_update_steady``) against
its per-row loop: the same random workload (admissions, aborts, block pressure that preempts,
stop tokens, length limits, speculative acceptance counts, one step in flight) runs twice, once
with the steady path disabled, and every step's rows, every commit and every request's counters
must agree. A fake runner stands in for the model: its outputs are a seeded function of the
step's rows, so both runs see the same tokens."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid_engine.config import SchedulerConfig
from hybrid_engine.scheduling.request import Request, Status
from hybrid_engine.sampling_params import SamplingParams
from hybrid_engine.scheduling.scheduler import Scheduler
from hybrid_engine.scheduling.scheduler_output import ModelRunnerOutput

EOS, STOP = 2, 7


def _outputs(sched, k: int, seed: int) -> ModelRunnerOutput:
    """The runner's output for a step: decode rows first (the runner's step order), tokens drawn
    from a small vocabulary so stop ids occur, 1..1+K valid tokens on decode rows."""
    order = [r for r in sched.rows if r.is_decode] + [r for r in sched.rows if not r.is_decode]
    rng = np.random.default_rng(seed)
    n = len(order)
    sampled = np.full((n, 1 + k), -1, dtype=np.int64)
    num_valid = np.zeros(n, dtype=np.int64)
    num_drafts = np.zeros(n, dtype=np.int64)
    for i, r in enumerate(order):
        if not r.samples:
            continue
        nv = int(rng.integers(1, 2 + k)) if r.is_decode else 1
        sampled[i, :nv] = rng.integers(0, 60, nv)
        num_valid[i] = nv
        num_drafts[i] = int(rng.integers(0, k + 1)) if r.is_decode else 0
    return ModelRunnerOutput(sched.step_id, tuple(r.req_id for r in order), sampled, num_valid, num_drafts)


def _run(k: int, seed: int, steady: bool, monkeypatch, steps: int = 160):
    """Drive one scheduler through a seeded workload; returns the per-step trace and the number of
    steps the steady path scheduled."""
    if not steady:
        monkeypatch.setattr(Scheduler, "_schedule_steady", lambda self: None)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    s = Scheduler(sc, max_model_len=256, block_size=4, num_kv_blocks=34, num_slots=9, num_spec=k)
    rng = np.random.default_rng(seed)
    trace, inflight, n_steady, made = [], None, 0, 0
    stats = {"preemptions": 0}
    for step in range(steps):
        if rng.random() < 0.25 and made < 40:                     # a new request
            p = SamplingParams(max_tokens=int(rng.integers(1, 60)), ignore_eos=bool(rng.random() < 0.5),
                               stop_token_ids=[STOP] if rng.random() < 0.3 else [])
            s.add_request(Request(f"r{made}", rng.integers(10, 60, int(rng.integers(1, 30))).tolist(), p, 0,
                                  eos_token_ids=(EOS,)))
            made += 1
        if rng.random() < 0.04 and s.requests:                   # an abort
            rid = sorted(s.requests)[int(rng.integers(0, len(s.requests)))]
            s.abort(rid)
        if not s.has_unfinished() and inflight is None:
            continue
        so = s.schedule() if s.has_unfinished() else None
        if so is not None and not so.rows:
            s.requeue_removed(so.removed_req_ids)
            so = None
        if so is not None:
            n_steady += so.decode is not None
            trace.append(("rows", so.step_id, so.rows, so.new_requests, so.removed_req_ids))
        done, inflight = inflight, so                               # one step in flight
        if done is not None:
            touched = s.update_from_output(done, _outputs(done, k, seed * 1000 + done.step_id))
            trace.append(("commit", done.step_id, [r.request_id for r in touched]))
        trace.append(("state", sorted(
            (r.request_id, r.status.value, r.finish_reason, r.num_computed_tokens, r.num_inflight_steps,
             r.prefill_target, tuple(r.output_token_ids), tuple(r.block_ids), r.slot, r.epoch,
             r.metrics.num_steps, r.metrics.num_tokens_out, r.metrics.drafts_proposed,
             r.metrics.drafts_accepted, tuple(r.metrics.accepted_per_position), r.metrics.num_preemptions)
            for r in s.requests.values())))
        for rid in [rid for rid, r in s.requests.items() if r.finished]:
            r = s.pop_finished(rid)
            stats[r.finish_reason] = stats.get(r.finish_reason, 0) + 1
            stats["preemptions"] += r.metrics.num_preemptions
    return trace, n_steady, stats


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steady_path_equals_per_row_loop(k, seed, monkeypatch):
    got, n_steady, stats = _run(k, seed, steady=True, monkeypatch=monkeypatch)
    ref, n_ref, _ = _run(k, seed, steady=False, monkeypatch=monkeypatch)
    assert n_ref == 0
    assert n_steady >= 20, "the workload must exercise the steady path"
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert a == b
    assert stats["preemptions"] > 0 and stats.get("stop") and stats.get("length"), stats


def test_counters_live_in_the_table_while_running():
    """num_computed_tokens / num_inflight_steps / prefill_target are the table's while running, the
    request's own before and after (written back on removal)."""
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    s = Scheduler(sc, max_model_len=128, block_size=4, num_kv_blocks=40, num_slots=5, num_spec=0)
    a = Request("a", [5] * 6, SamplingParams(max_tokens=5, ignore_eos=True), 0)
    b = Request("b", [5] * 3, SamplingParams(max_tokens=5, ignore_eos=True), 0)
    s.add_request(a)
    s.add_request(b)
    assert a._table is None and a.num_computed_tokens == 0
    so = s.schedule()
    assert a._table is s.table and (a.num_computed_tokens, a.prefill_target) == (6, 6)
    assert s.table.computed[a._trow] == 6 and s.table.computed[b._trow] == 3
    a.num_computed_tokens = 4                                  # writes go to the table too
    assert s.table.computed[a._trow] == 4
    a.num_computed_tokens = 6
    s.abort("a")                                               # removal writes the counters back
    assert a._table is None and a.status is Status.FINISHED
    assert (a.num_computed_tokens, a.num_inflight_steps, a.prefill_target) == (6, 1, 6)
    assert b._trow == 0 and s.running == [b] and s.table.computed[0] == 3
    out = _outputs(so, 0, 0)
    s.update_from_output(so, out)
    assert b.num_inflight_steps == 0 and len(b.output_token_ids) == 1
    assert s.table.n_out[0] == 1


def test_steady_step_reuses_the_id_tuple():
    """While no request joins or leaves, each steady step hands the runner the same req-id tuple
    (the runner and the input batch key their caches on it)."""
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64)
    s = Scheduler(sc, max_model_len=256, block_size=4, num_kv_blocks=80, num_slots=5, num_spec=0)
    for i in range(3):
        s.add_request(Request(f"r{i}", [5] * (3 + i), SamplingParams(max_tokens=50, ignore_eos=True), 0))
    first = s.schedule()
    assert first.decode is None                                # prefill step: the per-row loop
    steps = [s.schedule() for _ in range(4)]
    assert all(x.decode is not None for x in steps)
    assert all(x.decode.req_ids is steps[0].decode.req_ids for x in steps)
    assert [r.start_pos for r in steps[1].rows] == [4, 5, 6]
    assert steps[0].num_tokens == 3
