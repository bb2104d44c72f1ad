"""Async + spec regressions (d) condense with aborts while a step is in flight, (e) accepted
counts follow their rows through condense; harness in async_harness.py."""

from async_harness import Spy, make_llm, run
from hybrid_engine import SamplingParams


# ------------------------------------------- (d) condense with aborts while a step is in flight

def _condense_scenario(hybrid_dir, prompts, hf12, oracle, aborts, k=3):
    table, made = oracle
    for i, p in enumerate(prompts):
        table[f"d{i}"] = p + hf12[i]
    llm = make_llm(hybrid_dir, k, max_num_seqs=8, max_num_batched_tokens=128, async_scheduling=True)
    eng = llm.engine
    spy = Spy(eng)
    moves = []
    batch = eng.runner.batch
    orig_move = batch._move
    batch._move = lambda src, dst: (moves.append((src, dst)), orig_move(src, dst))[1]
    inflight_at_abort = []
    orig_abort = eng.abort

    def abort(rid):
        inflight_at_abort.append(eng.inflight is not None and rid in {r.req_id for r in eng.inflight.sched.rows})
        return orig_abort(rid)
    eng.abort = abort
    plan = [(0, f"d{i}", p, SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]
    reqs = run(eng, plan, aborts)
    return reqs, spy, moves, inflight_at_abort


ABORTS = {2: ["d1", "d3"], 3: ["d2"], 4: ["d5"]}


def test_d_condense_after_aborts_in_flight_keeps_other_tokens(hybrid_dir, prompts, hf12, oracle):
    """Async, K=3: requests in the middle rows are aborted while the step carrying them is in
    flight; the next step removes them and condense() moves the last rows into the holes. The other
    requests' tokens are unchanged vs the same run without aborts, and equal transformers."""
    plain, _, _, _ = _condense_scenario(hybrid_dir, prompts, hf12, oracle, {})
    reqs, spy, moves, inflight = _condense_scenario(hybrid_dir, prompts, hf12, oracle, ABORTS)
    assert inflight and all(inflight)
    assert moves                                      # condense really moved rows
    aborted = {r for v in ABORTS.values() for r in v}
    for i in range(len(prompts)):
        rid = f"d{i}"
        if rid in aborted:
            assert reqs[rid].finish_reason == "abort"
            continue
        assert reqs[rid].output_token_ids == plain[rid].output_token_ids == hf12[i], rid


# ------------------------------------------ (e) accepted counts follow their rows through condense

def test_e_accepted_count_follows_row_moves(hybrid_dir, prompts, hf12, oracle):
    """The same scenario: rows whose step-row index changes between steps (aborts + condense, and
    the decode-first ordering) still read their own accepted count from the previous step's -1
    padded output, gathered through prev_positions; at least one of them would have read a different
    count by its new row index (so a row-indexed read would fail this test)."""
    reqs, spy, moves, _ = _condense_scenario(hybrid_dir, prompts, hf12, oracle, ABORTS)
    moved, sensitive = spy.check_decode_rows_read_their_own_state(
        {rid: r.prompt_token_ids for rid, r in reqs.items()})
    assert moves and moved > 0 and sensitive > 0
    for i in range(len(prompts)):
        rid = f"d{i}"
        if reqs[rid].finish_reason != "abort":
            assert reqs[rid].output_token_ids == hf12[i]
