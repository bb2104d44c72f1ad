"""Async + spec regressions (a) a reused slot / row starts clean, (c) the backup token is the last
committed token; harness in async_harness.py."""
import numpy as np
import pytest

from async_harness import Spy, make_llm, run
from hybrid_engine import SamplingParams
from hf_reference import hf_greedy


# --------------------------------------------------------------------- (a) reused slot / row state

@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("k", [0, 4])
def test_a_reused_slot_and_row_start_clean(hybrid_dir, prompts, hf12, oracle, async_scheduling, k):
    """max_num_seqs=1: every request reuses the one slot and row 0 right after the previous one finished
    (by length, by a stop token with a step still in flight, or by an abort while in flight). The
    oracle accepts most drafts, so the previous occupant leaves a large accepted count, real drafts
    and a last token behind; each new request must still match transformers, and its first decode
    row must read accepted count 1 and its own first token."""
    table, made = oracle
    llm = make_llm(hybrid_dir, k, max_num_seqs=1, async_scheduling=async_scheduling)
    eng = llm.engine
    if k:
        made[0].p_wrong, made[0].p_none = 0.05, 0.0
    spy = Spy(eng)
    plan, stop_of = [], {}
    for i, p in enumerate(prompts):
        rid = f"a{i}"
        table[rid] = p + hf12[i]
        stop = [hf12[i][5]] if i % 3 == 1 else []          # finishes early, a step in flight
        stop_of[rid] = stop
        plan.append((0, rid, p, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=stop)))
    # abort a2 once it has a few tokens (the step carrying it is in flight in async mode)
    reqs, t, aborted = {}, 0, False
    for _, rid, p, sp in plan:
        reqs[rid] = eng.make_request(p, sp, rid)
        eng.add_request(reqs[rid])
    while eng.has_work():
        if not aborted and len(reqs["a2"].output_token_ids) >= 3:
            assert eng.abort("a2")
            aborted = True
        eng.step()
        t += 1
    assert aborted
    for i, (_, rid, p, sp) in enumerate(plan):
        out = reqs[rid].output_token_ids
        if rid == "a2":
            assert reqs[rid].finish_reason == "abort" and out == hf12[i][:len(out)]
            continue
        want = hf12[i]
        if stop_of[rid]:
            want = want[:want.index(stop_of[rid][0]) + 1]
        assert out == want, rid
    assert len({n.slot for s in spy.steps.values() for n in s.new_requests}) == 1   # one slot, reused
    spy.check_decode_rows_read_their_own_state({rid: p for _, rid, p, _ in plan})
    for sid, rows in spy.decode.items():              # first decode row of each request reads a = 1
        for rid, a, tok, pos in rows:
            prev = max(s for s in spy.steps if s < sid and rid in spy.rows[s])
            if not next(r for r in spy.steps[prev].rows if r.req_id == rid).is_decode:
                assert a == 1
    if k:
        assert any(a == k + 1 for rows in spy.decode.values() for _, a, _, _ in rows)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_reused_slot_with_the_real_ngram_drafter(hybrid_dir, async_scheduling):
    """The same with the n-gram drafter (its per-slot token history must be reset on reuse):
    repetitive prompts make it propose real drafts; a request that follows in the same slot has a
    prompt whose n-grams would match the old history at other continuations."""
    rng = np.random.default_rng(3)
    base = rng.integers(3, 256, 6).tolist()
    prompts = [base * 4, base[:3] * 5 + [9], base[::-1] * 3, [base[0]], base * 2 + base[:2]]
    ref = hf_greedy(hybrid_dir, prompts, max_new_tokens=12)
    # fixed K: every step verifies drafts (adaptive n-gram soon stops drafting on random weights)
    llm = make_llm(hybrid_dir, 3, adaptive=False, max_num_seqs=1, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.stats()["drafts_proposed"] > 0



# ------------------------------------------------------------------------ (c) backup token rows

@pytest.mark.parametrize("async_scheduling", [True, False])
def test_c_backup_token_is_the_last_committed_token(hybrid_dir, prompts, hf12, oracle, async_scheduling):
    """Chunked prefill (budget 8, K=3) and preemption (a tiny KV pool): every row that sampled
    nothing (num_valid == 0, a partial prefill chunk) hands the drafter the last committed token of
    its request (the last prompt token, or for a request resumed after preemption its last
    committed output), never -1 and never a token past the end; rows that sampled hand it their
    last valid sampled token."""
    table, made = oracle
    for i, p in enumerate(prompts):
        table[f"c{i}"] = p + hf12[i]
    # prefix caching off: a request resumed after preemption must recompute its prompt in partial
    # chunks (with caching on, it may restore most of it and finish in one chunk)
    llm = make_llm(hybrid_dir, 3, max_num_seqs=2, max_num_batched_tokens=8, block_size=4, num_kv_blocks=17,
                   async_scheduling=async_scheduling, enable_prefix_caching=False)
    eng = llm.engine
    drafter = made[0]
    # record which token list each slot was (re)started with, in order with the proposals
    events = []
    orig_add, orig_propose = drafter.add_request, drafter.propose
    drafter.add_request = lambda slot, ids: (events.append(("add", int(slot), tuple(ids))), orig_add(slot, ids))[1]
    drafter.propose = lambda ctx: (events.append(("propose", len(drafter.seen))), orig_propose(ctx))[1]
    plan = [(i, f"c{i}", p, SamplingParams(max_tokens=12, ignore_eos=True)) for i, p in enumerate(prompts)]
    reqs = run(eng, plan)
    slot_tokens, n_partial, n_resumed = {}, 0, 0
    for ev in events:
        if ev[0] == "add":
            slot_tokens[ev[1]] = ev[2]
            continue
        seen = drafter.seen[ev[1]]
        for i, rid in enumerate(seen["req_ids"]):
            tok, nv = seen["input_token"][i], seen["num_valid"][i]
            assert tok >= 0
            if nv == 0:
                n_partial += 1
                started = slot_tokens[seen["slots"][i]]
                assert tok == started[-1], (rid, tok)
                n_resumed += len(started) > len(reqs[rid].prompt_token_ids)
            else:
                assert tok == seen["sampled"][i][nv - 1]
    assert n_partial > 0 and n_resumed > 0             # partial chunks, also of resumed requests
    for i, (_, rid, p, sp) in enumerate(plan):
        assert reqs[rid].output_token_ids == hf12[i]


@pytest.mark.parametrize("pool_part", ["ssm_state", "conv_state"])
def test_a_slot_left_non_finite_does_not_reach_the_next_request(hybrid_dir, pool_part):
    """A request whose Mamba state went non-finite leaves it in its slot; the next request given
    that slot starts fresh and must read zeros, not the stale values (NaN * 0 is NaN: the initial
    state is selected, not multiplied by the has-initial-state flag). Every slot of the pool part
    is filled with NaN, then the same prompts run again and equal their clean run."""
    from chaos_harness import assert_idle_and_clean
    llm = make_llm(hybrid_dir, max_num_seqs=2, async_scheduling=False)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for t in getattr(llm.engine.caches.mamba, pool_part):
        t.fill_(float("nan"))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.error for o in outs] == [None, None]
    assert [o.outputs[0].token_ids for o in outs] == clean
    assert_idle_and_clean(llm.engine)
