"""Fault isolation of the step loop (hybrid_engine/fault_isolation.py), by injection.

A fault injected at a random phase of random steps (chaos_harness.PHASES) across fuzzed workloads,
for every speculative method and async scheduling on and off, must end only the requests of that
step (finish_reason "error", the error naming the fault), never a request that was only waiting;
every other request's output equals its fault-free run; nothing leaks (slots, blocks, batch rows,
the step in flight); the engine serves the next request. Plus the concrete cases of issue 20: a
one-off commit fault (LLM and AsyncLLM), a KeyboardInterrupt inside LLM.generate, a cancelled
AsyncLLM step loop, and non-finite logits.
"""
import asyncio
import os
import re

import numpy as np
import pytest
import torch

from async_harness import forward_targets
from chaos_harness import PHASES, Injector, assert_idle_and_clean, drive, make_workload
from hybrid_engine import LLM, AsyncLLM, SamplingParams, SpeculativeConfig

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
SPECS = ["nospec", "ngram3", "draft_model2", "mtp2"]
RUNS = 2


_ENGINES = {}


@pytest.fixture(scope="module")
def hybrid(hybrid_dir):
    yield hybrid_dir
    _ENGINES.clear()


def make_llm(model_dir, spec_name="nospec", async_scheduling=True):
    """One LLM per (spec, async) for the module: every test leaves it idle and clean (checked),
    and the injector's wrappers are undone by monkeypatch after each test."""
    key = (spec_name, async_scheduling)
    if key not in _ENGINES:
        spec = {"nospec": None, "ngram3": SpeculativeConfig("ngram", 3),
                "draft_model2": SpeculativeConfig("draft_model", 2, model=str(model_dir)),
                "mtp2": SpeculativeConfig("mtp", 2)}[spec_name]
        _ENGINES[key] = LLM(model_dir, dtype="float32", device=DEV, max_num_seqs=2, max_num_batched_tokens=24,
                            block_size=4, num_kv_blocks=48, speculative_config=spec,
                            async_scheduling=async_scheduling)
    return _ENGINES[key]


def check_against_clean(clean, faulty, fired, first_fault):
    """Each request: either failed by one of this run's faults (named in its error, and it was not
    merely waiting when that fault fired; its tokens a prefix of the clean run's) or identical to
    its clean run."""
    failed = 0
    for rid, c in clean.items():
        f = faulty[rid]
        ct, ft = c.outputs[0].token_ids, f.outputs[0].token_ids
        if f.outputs[0].finish_reason == "error":
            m = re.search(r"InjectedFault\('(\w+)#(\d+)'\)", f.error or "")
            assert m, f"{rid} failed without naming an injected fault: {f.error!r}"
            k = int(m.group(2))
            assert first_fault <= k < len(fired)
            phase, waiting = fired[k]
            assert rid not in waiting, f"{rid} was only waiting when {phase}#{k} fired, yet it failed"
            assert ft == ct[:len(ft)], (rid, ft, ct)
            failed += 1
        else:
            assert f.error is None, (rid, f.error)
            assert (ft, f.outputs[0].finish_reason) == (ct, c.outputs[0].finish_reason), rid
    return failed


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("spec_name", SPECS)
def test_chaos_faults_end_only_their_step(hybrid, monkeypatch, spec_name, async_scheduling):
    llm = make_llm(hybrid, spec_name, async_scheduling=async_scheduling)
    eng = llm.engine
    rng = np.random.default_rng(SPECS.index(spec_name) * 2 + async_scheduling)
    inj = Injector(eng, monkeypatch)
    phases_hit, failed = set(), 0
    for run in range(RUNS):
        # seeded sampling is batch invariant; with draft probabilities (draft model, MTP) the
        # acceptance draws depend on drafts made in a different batch: those runs stay greedy
        wl = make_workload(rng, 4, sampled=spec_name in ("nospec", "ngram3"), prefix=f"r{run}")
        clean = drive(eng, wl)
        assert_idle_and_clean(eng)
        plan = {int(s): str(rng.choice(PHASES)) for s in rng.integers(0, 14, 2)}
        n0 = len(inj.fired)
        faulty = drive(eng, wl, inj, plan)
        assert_idle_and_clean(eng)
        failed += check_against_clean(clean, faulty, inj.fired, n0)
        phases_hit |= {p for p, _ in inj.fired[n0:]}
    assert phases_hit, "no fault fired: the test would prove nothing"
    assert failed, "no request was failed by a fault"
    # the engine serves the next request exactly
    wl = make_workload(rng, 2, sampled=False, prefix="probe")
    again = drive(eng, wl)
    assert all(o.error is None for o in again.values())
    assert_idle_and_clean(eng)


@pytest.mark.parametrize("phase", PHASES)
def test_every_phase_isolated(hybrid, monkeypatch, phase):
    """Each phase, deterministically: a fault at step 2 of a 3-request workload (max_num_seqs=2,
    so one request waits) with async scheduling; the waiting request is untouched."""
    llm = make_llm(hybrid, "ngram3")
    eng = llm.engine
    wl = [(0, [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True), "a"),
          (0, [9, 10], SamplingParams(max_tokens=6, ignore_eos=True), "b"),
          (0, [11, 12, 13], SamplingParams(max_tokens=6, ignore_eos=True), "c")]
    clean = drive(eng, wl)
    inj = Injector(eng, monkeypatch)
    faulty = drive(eng, wl, inj, {2: phase})
    assert [p for p, _ in inj.fired] == [phase]
    assert check_against_clean(clean, faulty, inj.fired, 0) >= 1
    if phase not in ("update_batch", "output"):   # these two fire later: at c's admission, at the end
        assert faulty["c"].error is None              # "c" waited behind "a" and "b" when it fired
    assert_idle_and_clean(eng)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_one_off_commit_fault_does_not_wedge_llm(hybrid, monkeypatch, async_scheduling):
    """Issue 20: one exception in the commit used to leave the step's requests RUNNING forever
    ("scheduler made no progress" on every later call)."""
    llm = make_llm(hybrid, async_scheduling=async_scheduling)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    clean = llm.generate(prompts, params, use_tqdm=False)
    sched = llm.engine.scheduler
    orig, calls = sched.update_from_output, {"n": 0}

    def commit(*a):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OverflowError("one-off commit fault")
        return orig(*a)
    monkeypatch.setattr(sched, "update_from_output", commit)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs[:2]] == ["error", "error"]
    assert all("one-off commit fault" in o.error for o in outs[:2])
    assert outs[2].outputs[0].token_ids == clean[2].outputs[0].token_ids     # it was waiting
    assert_idle_and_clean(llm.engine)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in clean]


def test_async_commit_fault_spares_waiting_and_later_requests(hybrid, monkeypatch):
    """Issue 20: with AsyncLLM a commit fault failed every request, including waiting ones."""
    eng = AsyncLLM(hybrid, dtype="float32", device=DEV, max_num_seqs=2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    async def run_all():
        async def one(p, rid):
            toks, last = [], None
            async for out in eng.generate(p, params, request_id=rid):
                toks += out.outputs[0].token_ids
                last = out
            return toks, last
        return await asyncio.gather(*[one(p, f"x{i}") for i, p in enumerate(prompts)])
    clean = asyncio.run(run_all())
    sched = eng.engine.scheduler
    orig, calls = sched.update_from_output, {"n": 0}

    def commit(*a):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("one-off commit fault")
        return orig(*a)
    monkeypatch.setattr(sched, "update_from_output", commit)
    res = asyncio.run(run_all())
    assert [r[1].outputs[0].finish_reason for r in res] == ["error", "error", "length"]
    assert res[2][0] == clean[2][0]
    assert [r[0] for r in asyncio.run(run_all())] == [c[0] for c in clean]       # and the next call works
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    eng.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_keyboard_interrupt_in_generate_aborts_its_requests(hybrid, monkeypatch, async_scheduling):
    """Issue 20: an interrupt inside LLM.generate used to leave its requests in the scheduler,
    to run silently during the next call."""
    llm = make_llm(hybrid, async_scheduling=async_scheduling)
    eng = llm.engine
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    clean = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    # the forward phase: wherever the step's forward runs (executor, or a fused greedy-graph replay)
    for phase in [forward_targets(eng.runner), [(eng.scheduler, "update_from_output")],
                  [(eng.scheduler, "schedule")]]:
        calls = {"n": 0}
        saved = [(obj, name, getattr(obj, name)) for obj, name in phase]
        for obj, name, orig in saved:
            def interrupting(*a, _orig=orig, _calls=calls, **k):
                _calls["n"] += 1
                if _calls["n"] == 3:
                    raise KeyboardInterrupt
                return _orig(*a, **k)
            monkeypatch.setattr(obj, name, interrupting)
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[9, 10, 11], [12, 13]], params, use_tqdm=False)
        for obj, name, orig in saved:
            monkeypatch.setattr(obj, name, orig)
        assert not eng.scheduler.requests and not eng.has_work()
        out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == clean[0].outputs[0].token_ids
        assert eng.stats()["requests_finished"] >= 2
        assert_idle_and_clean(eng)


def test_cancelled_step_loop_ends_every_stream_promptly(hybrid_dir):
    """Issue 20: cancelling the step-loop task left every stream hanging, then ending with the
    misleading "cache too small" message. Now they end at once with "abort" saying why, and the
    next generate starts a new loop."""
    eng = AsyncLLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=2)
    params = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        async def one(p, rid):
            last = None
            async for out in eng.generate(p, params, request_id=rid):
                last = out
            return last
        tasks = [asyncio.ensure_future(one(p, f"s{i}")) for i, p in enumerate([[5, 6], [7, 8, 9], [10]])]
        while eng.engine.stats()["steps"] < 3:
            await asyncio.sleep(0.001)
        eng._task.cancel()
        lasts = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        toks = []
        async for out in eng.generate([5, 6], SamplingParams(max_tokens=3, ignore_eos=True)):
            toks += out.outputs[0].token_ids
        return lasts, toks
    lasts, toks = asyncio.run(main())
    for last in lasts:
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert "cancelled" in last.error and "cache" not in last.error
    assert len(toks) == 3
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    eng.shutdown()


@pytest.mark.parametrize("spec_name", ["nospec", "ngram3"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_nonfinite_logits_end_the_row_with_an_error(hybrid, monkeypatch, spec_name, async_scheduling):
    """A NaN in one row's logits (step 3): that request ends with "error" naming non-finite logits
    and no token of that step; the other request equals its clean run; a full NaN step ends both
    rows of it and spares the waiting one."""
    llm = make_llm(hybrid, spec_name, async_scheduling=async_scheduling)
    ex = llm.engine.runner.executor
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=3),
              SamplingParams(max_tokens=6, ignore_eos=True)]
    clean = llm.generate(prompts, params, use_tqdm=False)
    for rows in (slice(0, 1), slice(None)):
        orig, calls = ex.forward, {"n": 0}

        def forward(fb, _orig=orig, _calls=calls, _rows=rows):
            hidden, logits = _orig(fb)
            _calls["n"] += 1
            if _calls["n"] == 3:
                logits = logits.clone()
                logits[_rows, 7] = float("nan")
            return hidden, logits
        monkeypatch.setattr(ex, "forward", forward)
        outs = llm.generate(prompts, params, use_tqdm=False)
        monkeypatch.setattr(ex, "forward", orig)
        bad = [o for o in outs if o.outputs[0].finish_reason == "error"]
        assert len(bad) == (1 if rows == slice(0, 1) else 2)
        for o, c in zip(outs, clean):
            t, ct = o.outputs[0].token_ids, c.outputs[0].token_ids
            if o in bad:
                assert "non-finite logits" in o.error
                assert t == ct[:len(t)] and len(t) < len(ct)
            else:
                assert t == ct and o.error is None
        assert outs[2] not in bad                      # waiting behind the first two
        assert_idle_and_clean(llm.engine)


def test_nonfinite_flag_costs_no_sync():
    """The flag travels in the step's one D2H payload: the runner's payload marks the row and the
    host unpacking reports it (step_io.NONFINITE), while the device tokens stay valid ids."""
    from hybrid_engine.step.step_io import NONFINITE, mark_nonfinite
    sampled = torch.tensor([[4, -1], [7, 8], [2, -1]])
    bad = torch.tensor([False, True, False])
    payload = mark_nonfinite(sampled, bad)
    assert payload.tolist() == [[4, -1], [NONFINITE, NONFINITE], [2, -1]]
    assert sampled.tolist() == [[4, -1], [7, 8], [2, -1]]          # the next step's inputs: unchanged
    from hybrid_engine.sampling.sampler import nonfinite_rows
    x = torch.randn(5, 11)
    x[1, 3], x[2, 0], x[3] = float("nan"), float("inf"), float("-inf")
    x[4, 2] = float("-inf")                                        # one masked token is fine
    assert nonfinite_rows(x).tolist() == [False, True, True, True, False]


def test_async_chaos_streams(hybrid, monkeypatch):
    """AsyncLLM with concurrent streams and faults at random phases of random steps: failed streams
    end with "error" naming the fault; every other stream equals its clean run; no leaks."""
    eng = AsyncLLM(hybrid, dtype="float32", device=DEV, max_num_seqs=3, max_num_batched_tokens=24,
                   block_size=4, num_kv_blocks=48, speculative_config=SpeculativeConfig("ngram", 2))
    core = eng.engine
    rng = np.random.default_rng(5)
    inj = Injector(core, monkeypatch)
    step_phases = [p for p in PHASES if p != "output"]          # AsyncLLM builds outputs in _take

    async def run(wl, plan):
        async def one(prompt, params, rid):
            toks, last = [], None
            async for out in eng.generate(prompt, params, request_id=rid):
                toks += out.outputs[0].token_ids
                last = out
            return rid, toks, last

        async def arm():
            for s, phase in sorted(plan.items()):
                while core.stats()["steps"] < s:
                    await asyncio.sleep(0.0005)
                inj.arm(phase)
        tasks = [asyncio.ensure_future(one(p, sp, rid)) for _, p, sp, rid in wl]
        armer = asyncio.ensure_future(arm())
        res = await asyncio.gather(*tasks)
        armer.cancel()
        inj.armed = None
        return {rid: (toks, last) for rid, toks, last in res}
    for r in range(3):
        wl = make_workload(rng, 4, sampled=True, prefix=f"a{r}")
        clean = asyncio.run(run(wl, {}))
        n0 = len(inj.fired)
        base = core.stats()["steps"]
        faulty = asyncio.run(run(wl, {base + int(s): str(rng.choice(step_phases)) for s in rng.integers(1, 10, 2)}))
        for rid, (ct, c) in clean.items():
            ft, f = faulty[rid]
            if f.outputs[0].finish_reason == "error":
                m = re.search(r"#(\d+)", f.error)
                assert m and int(m.group(1)) >= n0 and rid not in inj.fired[int(m.group(1))][1]
                assert ft == ct[:len(ft)]
            else:
                assert (ft, f.outputs[0].finish_reason) == (ct, c.outputs[0].finish_reason)
        st = eng.stats()
        assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
        assert not core.scheduler.requests
    assert inj.fired
    eng.shutdown()


def test_async_output_fault_ends_only_that_stream(hybrid, monkeypatch):
    """Building one stream's output raises (e.g. a detokeniser failure): that stream alone ends with
    "error" naming it; its request leaves the engine; the other streams are unchanged."""
    eng = AsyncLLM(hybrid, dtype="float32", device=DEV, max_num_seqs=3)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = {"o0": [5, 6, 7], "o1": [8, 9], "o2": [10, 11, 12]}

    async def run_all():
        async def one(rid):
            toks, last = [], None
            async for out in eng.generate(prompts[rid], params, request_id=rid):
                toks += out.outputs[0].token_ids
                last = out
            return rid, toks, last
        return dict((rid, (t, l)) for rid, t, l in await asyncio.gather(*[one(r) for r in prompts]))
    clean = asyncio.run(run_all())
    orig, calls = eng.engine.make_output, {"n": 0}

    def make_output(req, delta_from=0):
        if req.request_id == "o1":
            calls["n"] += 1
            if calls["n"] == 2:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return orig(req, delta_from)
    monkeypatch.setattr(eng.engine, "make_output", make_output)
    res = asyncio.run(run_all())
    assert res["o1"][1].outputs[0].finish_reason == "error" and "injected" in res["o1"][1].error
    assert res["o1"][0] == clean["o1"][0][:len(res["o1"][0])]
    for rid in ("o0", "o2"):
        assert res[rid][0] == clean[rid][0] and res[rid][1].error is None
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    assert not eng.engine.scheduler.requests
    eng.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fault_before_anything_runs_is_no_wedge(hybrid, monkeypatch, async_scheduling):
    """A schedule fault at the very first step fails nobody (nothing runs yet: the waiting
    requests are untouched); that must not read as "no progress" and stop the loop."""
    llm = make_llm(hybrid, async_scheduling=async_scheduling)
    eng = llm.engine
    wl = [(0, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), "f0"),
          (0, [8, 9], SamplingParams(max_tokens=3, ignore_eos=True), "f1")]
    clean = drive(eng, wl)
    inj = Injector(eng, monkeypatch)
    faulty = drive(eng, wl, inj, {0: "schedule"})
    assert [p for p, _ in inj.fired] == ["schedule"]
    for rid in clean:
        assert faulty[rid].error is None
        assert faulty[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids
    assert_idle_and_clean(eng)
