"""Named regressions for the async + spec bug classes (notes/vllm-hybrid-spec.md sections 1 and 3,
DESIGN.md section 8), on CPU.

Most tests run with an *oracle drafter* registered as ``DRAFTERS["ngram"]``: it proposes the
correct greedy continuation (looked up by request id and absolute position in a precomputed
reference) corrupted at random positions (a wrong token, or -1 = no draft), so acceptance counts
are random in 1..K+1 while every output must still be the plain greedy one.

A *spy* records what the device actually received: for every step, the scheduler's rows, and from
the model's ForwardBatch, for each decode row its Mamba slot, accepted count (``num_accepted``),
first input token and its position; and for every committed step each request's host output. From
these the tests check, independently of the runner's own bookkeeping, that every decode row reads
*its own* previous accepted count / last token / position (through ``prev_positions``), whatever
the row moves, slot reuses, aborts and in-flight steps.
"""
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.request import Status
from hybrid_engine.testing import hf_greedy, hf_logits
from spec.drafters import DRAFTERS, Drafter

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
VOCAB = 256


# ------------------------------------------------------------------------------------- helpers

class OracleDrafter(Drafter):
    """Drafts = reference continuation after ``input_pos``, each position independently replaced
    by a wrong token (p_wrong) or by -1 (p_none). Records every DraftContext it sees."""
    has_probs = False

    def __init__(self, k, table, seed=0, p_wrong=0.35, p_none=0.1):
        self.num_spec, self.table = k, table
        self.rng = np.random.default_rng(seed)
        self.p_wrong, self.p_none = p_wrong, p_none
        self.added: list[tuple[int, tuple[int, ...]]] = []     # (slot, token_ids) per add_request
        self.seen: list[dict] = []

    def add_request(self, slot, token_ids):
        self.added.append((int(slot), tuple(int(t) for t in token_ids)))

    def propose(self, ctx):
        k, rng = self.num_spec, self.rng
        pos = ctx.input_pos.tolist()
        self.seen.append(dict(req_ids=ctx.req_ids, slots=ctx.slots.tolist(), num_valid=ctx.num_valid.tolist(),
                              input_token=ctx.input_token.tolist(), input_pos=pos, sampled=ctx.sampled.tolist()))
        out = torch.full((len(ctx.req_ids), k), -1, dtype=torch.int64)
        for i, rid in enumerate(ctx.req_ids):
            seq = self.table.get(rid, ())
            for j in range(k):
                idx = pos[i] + 1 + j
                tok = seq[idx] if idx < len(seq) else int(rng.integers(3, VOCAB))
                r = rng.random()
                if r < self.p_wrong:
                    tok = (tok + int(rng.integers(1, VOCAB))) % VOCAB
                elif r < self.p_wrong + self.p_none:
                    tok = -1
                out[i, j] = tok
        return out.to(ctx.sampled.device), None


@pytest.fixture
def oracle(monkeypatch):
    """Register the oracle as the "ngram" method; returns the table to fill and the drafters built."""
    table, made = {}, []

    def factory(engine, **kw):
        d = OracleDrafter(engine.num_spec, table, seed=len(made), **kw)
        made.append(d)
        return d
    monkeypatch.setitem(DRAFTERS, "ngram", factory)
    return table, made


class Spy:
    """Records launched steps, the device inputs of decode rows and committed host outputs."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: dict[int, object] = {}           # step_id -> SchedulerOutput
        self.decode: dict[int, list[tuple]] = {}     # step_id -> [(req_id, a, first_token, first_pos)]
        self.out: dict[int, dict[str, tuple]] = {}   # step_id -> req_id -> (valid tokens, num_valid)
        self.slot_owner: dict[int, str] = {}
        self.rows: dict[int, dict[str, int]] = {}    # step_id -> req_id -> step row (token order)
        self.committed: list[int] = []                # step ids in commit order
        self._cur = None
        runner, model = engine.runner, engine.model
        orig_execute, orig_forward, orig_commit = runner.execute, model.forward, engine.commit
        k = engine.num_spec

        def execute(sched):
            self._cur = sched.step_id
            self.steps[sched.step_id] = sched
            for new in sched.new_requests:
                self.slot_owner[new.slot] = new.req_id
            order = [r.req_id for r in sched.rows if r.is_decode] + [r.req_id for r in sched.rows if not r.is_decode]
            self.rows[sched.step_id] = {rid: i for i, rid in enumerate(order)}
            return orig_execute(sched)

        def forward(fb, caches):
            m, s = fb.mamba, 1 + k
            nd = m.num_decode_rows
            slots, acc = m.decode_slots.tolist(), m.num_accepted.tolist()
            ids, pos = fb.input_ids[:nd * s:s].tolist(), fb.positions[:nd * s:s].tolist()
            self.decode[self._cur] = [(self.slot_owner[slots[i]], acc[i], ids[i], pos[i]) for i in range(nd)]
            return orig_forward(fb, caches)

        def commit(handle, out):
            touched = orig_commit(handle, out)
            got = {r.request_id for r in touched}        # outputs the scheduler kept (epoch, live)
            self.committed.append(handle.sched.step_id)
            self.out[handle.sched.step_id] = {
                rid: (out.sampled[i, :int(out.num_valid[i])].tolist(), int(out.num_valid[i]))
                for i, rid in enumerate(out.req_ids) if rid in got}
            return touched
        runner.execute, model.forward, engine.commit = execute, forward, commit

    def check_decode_rows_read_their_own_state(self, prompts: dict[str, list[int]]):
        """For every decode row of step N: accepted count == its previous step's valid count, first
        input == its last valid token, position == tokens committed before it - 1. Returns the
        number of rows whose step row changed since their previous step."""
        last: dict[str, tuple[int, int]] = {}          # req_id -> (step id, row) it last ran in
        produced: dict[str, int] = {}                  # tokens committed by steps already seen
        moved = sensitive = 0
        for sid in sorted(self.steps):
            sched = self.steps[sid]
            rows = {r.req_id: r for r in sched.rows}
            for rid, a, tok, pos in self.decode.get(sid, ()):
                psid, prow = last[rid]
                toks, nv = self.out[psid][rid]
                assert a == max(nv, 1), f"step {sid} {rid}: accepted count {a}, its own is {nv}"
                assert tok == toks[-1], f"step {sid} {rid}: first input {tok}, its last token {toks[-1]}"
                assert pos == len(prompts[rid]) + produced[rid] - 1, f"step {sid} {rid}: position {pos}"
                row = self.rows[sid][rid]
                if row != prow:
                    moved += 1
                    other = [r for r, i in self.rows[psid].items() if i == row]
                    if other and other[0] in self.out[psid] and self.out[psid][other[0]][1] != nv:
                        sensitive += 1                 # reading by row would have given a wrong count
            for rid, i in self.rows[sid].items():
                if sid in self.out and rid in self.out[sid] and rows[rid].samples:
                    last[rid] = (sid, i)
            for rid, (toks, _) in self.out.get(sid, {}).items():
                if rows[rid].samples:
                    produced[rid] = produced.get(rid, 0) + len(toks)
        return moved, sensitive


def assert_hf_greedy(model_dir, prompt, output):
    """``output`` is transformers' greedy continuation of ``prompt``: every token is the argmax of
    transformers' logits given everything before it (one full forward, teacher forced)."""
    if not output:
        return
    logits = hf_logits(model_dir, list(prompt) + list(output)[:-1])
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == list(output)


def make_llm(model_dir, k=None, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEV)
    spec = SpeculativeConfig("ngram", k) if k else None
    return LLM(model_dir, speculative_config=spec, **kw)


def run(engine, plan, abort_at=None, max_steps=5000):
    """plan: [(arrival_step, req_id, prompt, params)]; abort_at: {step: [req_id]}. Returns requests."""
    abort_at = abort_at or {}
    reqs, t = {}, 0
    last = max(a for a, *_ in plan)
    while t <= last or engine.has_work():
        for arrival, rid, prompt, params in plan:
            if arrival == t:
                reqs[rid] = engine.make_request(prompt, params, rid)
                engine.add_request(reqs[rid])
        for rid in abort_at.get(t, ()):
            assert engine.abort(rid), rid
        engine.step()
        t += 1
        assert t < max_steps
    for rid in reqs:
        engine.scheduler.pop_finished(rid)
    return reqs


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(3, 256, n).tolist() for n in (1, 40, 17, 2, 9, 33, 5, 24)]


@pytest.fixture(scope="module")
def hf12(hybrid_dir, prompts):
    return hf_greedy(hybrid_dir, prompts, max_new_tokens=12)


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
    llm = make_llm(hybrid_dir, 3, max_num_seqs=1, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.stats()["drafts_proposed"] > 0


# --------------------------------------------------------------------------- (b) counter drift

@pytest.mark.parametrize("async_scheduling", [True, False])
def test_b_counters_do_not_drift_over_500_steps(hybrid_dir, oracle, async_scheduling):
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
    rng = np.random.default_rng(500)
    n_req = 40
    plan_prompts = [rng.integers(3, 256, int(rng.integers(1, 41))).tolist() for _ in range(n_req)]
    max_toks = [int(rng.integers(60, 180)) for _ in range(n_req)]
    kw = dict(max_num_seqs=3, max_num_batched_tokens=24, block_size=16, num_kv_blocks=64)
    base = make_llm(hybrid_dir, None, **{**kw, "max_num_seqs": 8}).generate(
        plan_prompts, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_toks], use_tqdm=False)
    ref = [o.outputs[0].token_ids for o in base]
    llm = make_llm(hybrid_dir, k, async_scheduling=async_scheduling, **kw)
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
        if eng._inflight is not None:
            inflight = {r.req_id: r.num_tokens for r in eng._inflight.sched.rows}
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
    for i in range(0, next_req, 4):                    # transformers (teacher-forced) on a subset
        assert_hf_greedy(hybrid_dir, plan_prompts[i], ref[i])


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
    llm = make_llm(hybrid_dir, 3, max_num_seqs=2, max_num_batched_tokens=8, block_size=4, num_kv_blocks=17,
                   async_scheduling=async_scheduling)
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
        inflight_at_abort.append(eng._inflight is not None and rid in {r.req_id for r in eng._inflight.sched.rows})
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
