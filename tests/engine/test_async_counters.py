"""Async + spec regressions (b) counters do not drift over 500 steps; removals of steps that
never ran; harness in async_harness.py."""
import numpy as np
import pytest

from async_harness import Spy, assert_hf_greedy, make_llm, run
from hybrid_engine import SamplingParams
from hybrid_engine.scheduling.request import Status


# --------------------------------------------------------------------------- (b) counter drift

@pytest.fixture(scope="module")
def drift_plan(hybrid_dir):
    """The counter-drift workload and its no-spec reference outputs (the same for both
    scheduling modes, so generated once): (prompts, max_tokens, reference outputs)."""
    rng = np.random.default_rng(500)
    n_req = 40
    plan_prompts = [rng.integers(3, 256, int(rng.integers(1, 41))).tolist() for _ in range(n_req)]
    max_toks = [int(rng.integers(60, 180)) for _ in range(n_req)]
    base = make_llm(hybrid_dir, None, **{**DRIFT_KW, "max_num_seqs": 8}).generate(
        plan_prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_toks], use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in base]
    # transformers (teacher-forced) on every 4th request: a superset of the ones each test reaches
    for i in range(0, n_req, 4):
        assert_hf_greedy(hybrid_dir, plan_prompts[i], ref[i])
    return plan_prompts, max_toks, ref


DRIFT_KW = dict(max_num_seqs=3, max_num_batched_tokens=24, block_size=16, num_kv_blocks=64)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_b_counters_do_not_drift_over_500_steps(hybrid_dir, oracle, drift_plan, async_scheduling):
    """K=4, random acceptance, >= 500 steps, requests arriving over time (max_num_seqs=3, no
    preemption). Definitions, for a running request r with prompt length P and O committed outputs:

      committed(r) = P + O - 1 once r has committed a token (the last output is not in the cache
                     yet), else the prefill tokens of its committed steps;
      inflight(r)  = tokens scheduled for r in the step still in flight (async), else 0.

    After every ``engine.step()``: ``r.num_computed_tokens == committed(r) + inflight(r)``.
    For every decode row at launch: ``row.start_pos - true_start == slack`` where true_start is the
    position the device used for its first token, slack = 0 in sync mode and, in async mode,
    (1 + K) - a when r's previous step was a verify step that kept a tokens (else 0): the CPU value
    is an upper bound corrected exactly one step late, never integrated. The outputs equal the
    no-spec run and transformers' greedy continuation."""
    k = 4
    table, made = oracle
    plan_prompts, max_toks, ref = drift_plan
    n_req = len(plan_prompts)
    llm = make_llm(hybrid_dir, k, async_scheduling=async_scheduling, **DRIFT_KW)
    eng = llm.engine
    made[0].p_wrong, made[0].p_none = 0.4, 0.1
    spy = Spy(eng)
    reqs = {}
    next_req, t = 0, 0
    while (next_req < n_req and t < 500) or eng.has_work():
        if (next_req < n_req and t < 500 and t % 3 == 0
                and len(eng.scheduler.running) + len(eng.scheduler.waiting) < 3):
            rid = f"b{next_req}"
            table[rid] = plan_prompts[next_req] + ref[next_req]
            reqs[rid] = eng.make_request(plan_prompts[next_req],
                                         SamplingParams(max_tokens=max_toks[next_req], ignore_eos=True), rid)
            eng.add_request(reqs[rid])
            next_req += 1
        eng.step()
        t += 1
        committed_prefill: dict[str, int] = {}        # prefill tokens of committed steps
        for sid in spy.committed:
            for r in spy.steps[sid].rows:
                if not r.is_decode:
                    committed_prefill[r.req_id] = committed_prefill.get(r.req_id, 0) + r.num_tokens
        inflight = {}
        if eng.inflight is not None:
            inflight = {r.req_id: r.num_tokens for r in eng.inflight.sched.rows}
        for r in eng.scheduler.running:
            assert r.status is Status.RUNNING
            p, o = len(r.prompt_token_ids), len(r.output_token_ids)
            true = p + o - 1 if o else committed_prefill.get(r.request_id, 0)
            assert r.num_computed_tokens == true + inflight.get(r.request_id, 0), (t, r.request_id)
    assert eng.stats()["steps"] >= 500
    epochs = {}
    for sched in spy.steps.values():                  # no preemption in this test
        for r in sched.rows:
            assert epochs.setdefault(r.req_id, r.epoch) == r.epoch
    for i in range(next_req):
        assert reqs[f"b{i}"].output_token_ids == ref[i], i
    # scheduled start positions vs the device's
    prev_row: dict[str, tuple[bool, int]] = {}
    accepted = []
    for sid in sorted(spy.steps):
        dev = {rid: pos for rid, _, _, pos in spy.decode.get(sid, ())}
        for r in spy.steps[sid].rows:
            if r.is_decode:
                was_decode, nv = prev_row[r.req_id]
                slack = (1 + k - nv) if (async_scheduling and was_decode) else 0
                assert r.start_pos - dev[r.req_id] == slack, (sid, r.req_id)
            if r.samples and r.req_id in spy.out.get(sid, {}):
                prev_row[r.req_id] = (r.is_decode, spy.out[sid][r.req_id][1])
                if r.is_decode:
                    accepted.append(spy.out[sid][r.req_id][1])
    assert set(accepted) == set(range(1, k + 2))       # acceptance really was random over 1..K+1
    spy.check_decode_rows_read_their_own_state({rid: r.prompt_token_ids for rid, r in reqs.items()})



# ------------------------------------------------------------- removals of steps that never ran

@pytest.mark.parametrize("async_scheduling", [True, False])
def test_removals_survive_steps_with_nothing_to_run(hybrid_dir, prompts, async_scheduling):
    """Found by the fuzzer: r0 finishes while every other request already has enough tokens in
    flight, so the next schedule has no rows; the engine used to drop that (empty) step together
    with its removed_req_ids, leaking r0's row in the input batch until it filled up ("input batch
    is full"). After draining, the rows left in the batch are exactly the pending removals."""
    llm = make_llm(hybrid_dir, None, max_num_seqs=2, async_scheduling=async_scheduling)
    eng = llm.engine
    for rnd in range(6):
        plan = [(0, f"x{rnd}-0", prompts[4], SamplingParams(max_tokens=3, ignore_eos=True)),
                (0, f"x{rnd}-1", prompts[6], SamplingParams(max_tokens=4, ignore_eos=True))]
        run(eng, plan)
        assert set(eng.runner.batch.req_id_to_row) <= eng.scheduler._removed
        assert eng.runner.batch.num_reqs <= 2
