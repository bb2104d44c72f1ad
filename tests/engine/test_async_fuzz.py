"""Seeded fuzzing of arrival / abort / preemption / chunked-prefill schedules (docs/design.md invariant 2).

Each schedule (2-6 requests, prompts of 1..40 tokens, max_tokens 1..12, random arrival steps,
random aborts between steps, greedy and seeded sampling, some stop tokens) drives ``EngineCore``
directly, step by step, once with ``async_scheduling=True`` and once with ``False`` (on a model of
one Mamba, attention, MLP and MoE block plus an MTP layer: ``fuzz_dir``), on tiny caches
(preemption) and small token budgets (chunked prefill). For every request that was not aborted:
 - async and sync give identical tokens and finish reasons;
 - greedy requests equal transformers' greedy continuation (``hf_greedy``, cached per prompt),
   cut at max_tokens / the first stop token;
 - seeded requests equal the same requests decoded without speculation on a roomy engine
   (spec / batch / preemption / chunking invariance; cached).
After each run every slot and KV block is back on the free lists (docs/design.md invariant 9).
Engines are built once per (mode, spec config, cache config) and reused across schedules, so
rows, slots and blocks are recycled between schedules too.
"""
import os

import numpy as np
import pytest

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hf_reference import hf_greedy

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
NUM_SCHEDULES = 100
MAX_TOKENS = 12
POOL_SIZE = 48


# every drafter: draft_model drafts with the target itself (its draws use the sampler's keys, so
# seeded spec == no spec exactly); MTP's q differs from p, so its seeded rows are checked async == sync
SPEC_CONFIGS = ["nospec", "ngram3", "draft_model2", "mtp2"]


def make_spec(name, model_dir):
    return {"nospec": None, "ngram3": SpeculativeConfig("ngram", 3),
            "draft_model2": SpeculativeConfig("draft_model", 2, model=str(model_dir)),
            "mtp2": SpeculativeConfig("mtp", 2)}[name]


# (max_num_seqs, max_num_batched_tokens, block_size, num_kv_blocks): tight KV pools preempt, small
# budgets chunk prefills. Every pool holds one request of 40 + 12 tokens plus its lookahead alone.
CACHE_CONFIGS = [
    (4, 16, 4, 20),
    (3, 8, 4, 24),
    (6, 32, 4, 22),
    (2, 12, 8, 12),
    (5, 24, 16, 8),
]


@pytest.fixture(scope="module")
def fuzz_dir(model_dirs):
    """One block of each kind (Mamba, attention, MLP, MoE) plus an MTP layer: every cache and
    drafter path the schedules exercise, at half the depth of the engine-core model (the
    invariants here are about scheduling, slots and blocks, not depth)."""
    return model_dirs("fuzz", pattern="M*-E", seed=1, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def pool():
    rng = np.random.default_rng(2024)
    lens = np.concatenate([[1, 2, 16, 17, 40], rng.integers(1, 41, POOL_SIZE - 5)])
    return [rng.integers(3, 256, int(n)).tolist() for n in lens]


@pytest.fixture(scope="module")
def hf_refs(fuzz_dir):
    cache = {}

    def get(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(fuzz_dir, [list(prompt)], MAX_TOKENS)[0]
        return cache[key]
    return get


@pytest.fixture(scope="module")
def engines(fuzz_dir):
    cache = {}

    def get(async_scheduling, spec, cfg):
        key = (async_scheduling, spec, cfg)
        if key not in cache:
            seqs, budget, bs, blocks = cfg
            cache[key] = LLM(fuzz_dir, dtype="float32", device=DEV, max_num_seqs=seqs,
                             max_num_batched_tokens=budget, block_size=bs, num_kv_blocks=blocks,
                             speculative_config=spec, async_scheduling=async_scheduling).engine
        return cache[key]
    return get


@pytest.fixture(scope="module")
def solo(fuzz_dir):
    """Seeded requests decoded without speculation on a roomy engine (seeded sampling is batch
    invariant, so a schedule's requests are generated together), cached."""
    llm = LLM(fuzz_dir, dtype="float32", device=DEV, max_num_seqs=8)
    cache = {}

    def get(items):
        todo = [(p, sp) for p, sp in items if _key(p, sp) not in cache]
        if todo:
            outs = llm.generate([p for p, _ in todo], [sp for _, sp in todo], use_tqdm=False)
            for (p, sp), o in zip(todo, outs):
                cache[_key(p, sp)] = (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        return [cache[_key(p, sp)] for p, sp in items]
    return get


def _key(prompt, sp):
    return (tuple(prompt), sp.max_tokens, sp.temperature, sp.top_k, sp.top_p, sp.seed,
            tuple(sp.stop_token_ids), sp.ignore_eos)


def make_schedule(seed, pool, hf_refs):
    rng = np.random.default_rng(seed)
    cfg = CACHE_CONFIGS[int(rng.integers(len(CACHE_CONFIGS)))]
    reqs = []
    for i in range(int(rng.integers(2, 7))):
        prompt = pool[int(rng.integers(len(pool)))]
        max_tokens = int(rng.integers(1, MAX_TOKENS + 1))
        greedy = rng.random() < 0.6
        stop = []
        if greedy and rng.random() < 0.3:      # a stop token the greedy continuation really hits
            stop = [hf_refs(prompt)[int(rng.integers(MAX_TOKENS))]]
        if greedy:
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=stop)
        else:
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=int(rng.integers(1 << 30)),
                                temperature=float(rng.choice([0.7, 1.0, 1.3])),
                                top_k=int(rng.choice([-1, 5, 40])), top_p=float(rng.choice([1.0, 0.9])))
        arrival = int(rng.integers(0, 10))
        abort = arrival + int(rng.integers(0, 8)) if rng.random() < 0.25 else None
        reqs.append(dict(rid=f"s{seed}-r{i}", prompt=prompt, params=sp, greedy=greedy,
                         arrival=arrival, abort=abort))
    return cfg, reqs


def drive(engine, reqs, max_steps=400):
    """Add requests at their arrival step and abort at their abort step (before that step runs)."""
    live = {}
    t = 0
    last_arrival = max(r["arrival"] for r in reqs)
    while t <= last_arrival or engine.has_work():
        for r in reqs:
            if r["arrival"] == t:
                req = engine.make_request(r["prompt"], r["params"], r["rid"])
                engine.add_request(req)
                live[r["rid"]] = req
            if r["abort"] == t and r["rid"] in live:
                engine.abort(r["rid"])
        engine.step()
        t += 1
        assert t < max_steps, "schedule did not drain"
    out = {}
    for rid, req in live.items():
        assert req.finished
        out[rid] = (list(req.output_token_ids), req.finish_reason, req.metrics.num_preemptions)
        engine.scheduler.pop_finished(rid)
    st = engine.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    return out


def preempted(r, res) -> bool:
    return any(res[mode][r["rid"]][2] for mode in (True, False))


def expected_greedy(ref, sp):
    toks = []
    for tok in ref[:sp.max_tokens]:
        toks.append(tok)
        if tok in sp.stop_token_ids:
            return toks, "stop"
    return toks, "length"


@pytest.mark.parametrize("spec_name", SPEC_CONFIGS)
@pytest.mark.parametrize("seed", range(NUM_SCHEDULES))
def test_fuzz_async_equals_sync_equals_reference(seed, spec_name, pool, hf_refs, engines, solo, fuzz_dir):
    spec = make_spec(spec_name, fuzz_dir)
    cfg, reqs = make_schedule(seed, pool, hf_refs)
    res = {mode: drive(engines(mode, spec, cfg), reqs) for mode in (True, False)}
    kept = [r for r in reqs if r["abort"] is None]
    seeded = [r for r in kept if not r["greedy"]]
    # seeded: vs the same requests decoded without speculation on a roomy engine (docs/design.md
    # invariant 2: the same seed gives the same tokens with or without spec, async or sync, whatever
    # the batch)
    seeded_ref = dict(zip([r["rid"] for r in seeded], solo([(r["prompt"], r["params"]) for r in seeded])))
    for r in kept:
        rid = r["rid"]
        if spec_name == "mtp2" and not r["greedy"] and preempted(r, res):
            # Known limitation: with probabilistic drafts (q != p) a preemption restarts the draft
            # phase (the resumed prefill samples the next token plainly instead of verifying the
            # old draft), so the tokens stay correctly distributed but depend on when it happened.
            continue
        assert res[True][rid][:2] == res[False][rid][:2], f"{rid}: async != sync ({cfg})"
        if r["greedy"]:
            want = expected_greedy(hf_refs(r["prompt"]), r["params"])
        elif spec_name == "mtp2":
            continue                                   # lossless in law only; async == sync above
        else:
            want = seeded_ref[rid]
        assert res[True][rid][:2] == want, f"{rid}: != reference ({cfg}, greedy={r['greedy']})"
    for r in reqs:                                     # aborted: a prefix of the un-aborted output
        if r["abort"] is not None:
            for mode in (True, False):
                toks, reason, _ = res[mode][r["rid"]]
                assert reason in ("abort", "stop", "length")
                if r["greedy"]:
                    full, _ = expected_greedy(hf_refs(r["prompt"]), r["params"])
                    assert toks == full[:len(toks)]


def test_fuzz_schedules_exercise_pressure(pool, hf_refs, engines, monkeypatch):
    """The schedule generator really produces preemption, chunked prefill, aborts with a step in
    flight and mid-batch condense moves (checked on a sample of schedules)."""
    from hybrid_engine.scheduling import scheduler as sched_mod
    from hybrid_engine.step import input_batch as ib_mod
    seen = {"preempt": 0, "chunk": 0, "move": 0, "abort_inflight": 0}
    orig_preempt, orig_row, orig_move = sched_mod.Scheduler._preempt, sched_mod.Scheduler._row, ib_mod.InputBatch._move

    def preempt(self, req):
        seen["preempt"] += 1
        return orig_preempt(self, req)

    def row(self, req, n):
        r = orig_row(self, req, n)
        seen["chunk"] += (not r.is_decode and not r.samples)
        return r

    def move(self, src, dst):
        seen["move"] += 1
        return orig_move(self, src, dst)
    monkeypatch.setattr(sched_mod.Scheduler, "_preempt", preempt)
    monkeypatch.setattr(sched_mod.Scheduler, "_row", row)
    monkeypatch.setattr(ib_mod.InputBatch, "_move", move)
    for seed in range(20):
        cfg, reqs = make_schedule(seed, pool, hf_refs)
        eng = engines(True, None, cfg)
        orig_abort = eng.abort

        def abort(rid, eng=eng, orig_abort=orig_abort):
            req = eng.scheduler.requests.get(rid)
            seen["abort_inflight"] += eng.inflight is not None and req is not None and not req.finished
            return orig_abort(rid)
        eng.abort = abort
        try:
            drive(eng, reqs)
        finally:
            del eng.abort
    assert all(v > 0 for v in seen.values()), seen

