"""Shared harness of the async + spec regression tests (test_async_slot_state.py,
test_async_counters.py, test_async_condense.py): stale per-slot and per-row state under async
scheduling and speculation (docs/design.md invariants 3-7), on CPU.

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
import torch

from hybrid_engine import LLM, SpeculativeConfig
from hf_reference import hf_logits
from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.spec.drafters import Drafter

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
        runner, executor = engine.runner, engine.runner.executor
        # the executor's forward sees every step's ForwardBatch, eager or replayed from a CUDA graph
        # (whose static buffers are already filled when it is called); the model's forward is not
        # called on a replay, so spying there would miss graph steps
        orig_execute, orig_forward, orig_commit = runner.execute, executor.forward, engine.commit
        k = engine.num_spec

        def execute(sched):
            self._cur = sched.step_id
            self.steps[sched.step_id] = sched
            for new in sched.new_requests:
                self.slot_owner[new.slot] = new.req_id
            order = [r.req_id for r in sched.rows if r.is_decode] + [r.req_id for r in sched.rows if not r.is_decode]
            self.rows[sched.step_id] = {rid: i for i, rid in enumerate(order)}
            return orig_execute(sched)

        def forward(fb):
            m, tokens_per_row = fb.mamba, 1 + k
            num_decode = m.num_decode_rows
            slots, acc = m.decode_slots.tolist(), m.num_accepted.tolist()
            first_tokens = slice(0, num_decode * tokens_per_row, tokens_per_row)   # each row's first token
            ids, pos = fb.input_ids[first_tokens].tolist(), fb.positions[first_tokens].tolist()
            # rows on the null slot are a graph bucket's padding
            self.decode[self._cur] = [(self.slot_owner[slots[i]], acc[i], ids[i], pos[i])
                                      for i in range(num_decode) if slots[i] != NULL_SLOT]
            return orig_forward(fb)

        def commit(handle, out):
            touched = orig_commit(handle, out)
            got = {r.request_id for r in touched}        # outputs the scheduler kept (epoch, live)
            self.committed.append(handle.sched.step_id)
            self.out[handle.sched.step_id] = {
                rid: (out.sampled[i, :int(out.num_valid[i])].tolist(), int(out.num_valid[i]))
                for i, rid in enumerate(out.req_ids) if rid in got}
            return touched
        runner.execute, executor.forward, engine.commit = execute, forward, commit

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


def make_llm(model_dir, k=None, adaptive=True, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEV)
    spec = SpeculativeConfig("ngram", k, adaptive=adaptive) if k else None
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


def forward_targets(runner) -> list[tuple[object, str]]:
    """(object, method name) pairs through which every step's forward runs, whatever its route: the
    executor's forward (eager or a CUDA graph replay), and each fused plan's ``replay`` (a greedy
    step graph replays prepare + forward + argmax without calling the executor). A fault injected
    into all of them fires in the step under test on CPU and on CUDA alike."""
    return [(runner.executor, "forward")] + [(p, "replay") for p in runner.plans if p.fused]
