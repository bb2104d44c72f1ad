"""AsyncLLM when a step fails: only that step's requests fail, batch rows are not leaked, and a
loop failure outside a step fails the streams and the engine recovers."""
import asyncio

import pytest

from async_harness import forward_targets
from async_llm_helpers import DEV, GREEDY, collect, make, prompts, reference  # noqa: F401
from hybrid_engine import LLM, SamplingParams


@pytest.mark.parametrize("where", ["before", "inside"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_step_fails_only_its_requests(hybrid_dir, prompts, reference, monkeypatch, where,
                                             async_scheduling):
    """Step 3 raises (before the runner touched anything, or inside the forward): the two requests in
    it end with finish_reason "error"; the queued one (max_num_seqs=2) and later ones succeed."""
    eng = make(hybrid_dir, max_num_seqs=2, async_scheduling=async_scheduling)
    runner = eng.engine.runner
    calls = {"n": 0, "in_failed": None}
    # the fault goes wherever the step's forward runs (executor or fused greedy-graph replay)
    targets = forward_targets(runner)
    orig_execute = runner.execute

    def execute(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            calls["in_failed"] = {r.req_id for r in sched.rows}
            if where == "before":
                raise RuntimeError("injected failure")
            saved = [(obj, name, getattr(obj, name)) for obj, name in targets]
            for obj, name, _ in saved:
                setattr(obj, name, boom)
            try:
                return orig_execute(sched)
            finally:
                for obj, name, orig in saved:
                    setattr(obj, name, orig)
        return orig_execute(sched)

    def boom(*a, **k):
        raise RuntimeError("injected failure")
    monkeypatch.setattr(runner, "execute", execute)

    async def main():
        res = await asyncio.gather(*[collect(eng, p, request_id=f"r{i}") for i, p in enumerate(prompts[:3])])
        later = await asyncio.gather(*[collect(eng, p, request_id=f"later{i}") for i, p in enumerate(prompts[3:])])
        return res, later
    res, later = asyncio.run(main())
    assert calls["in_failed"] == {"r0", "r1"}
    for i, (toks, last) in enumerate(res):
        if i < 2:
            assert last.outputs[0].finish_reason == "error" and "injected failure" in last.error
            assert toks == reference[i][:len(toks)]
        else:
            assert toks == reference[i] and last.outputs[0].finish_reason == "length"
    for (toks, last), ref in zip(later, reference[3:]):
        assert toks == ref and last.error is None
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    assert eng.engine.runner.batch.num_reqs <= 2           # failed rows left the batch
    eng.shutdown()


def test_failed_step_with_llm_generate(hybrid_dir, prompts, reference, monkeypatch):
    """The sync API shares the step logic: the failed request reports "error", the rest succeed."""
    llm = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=1)
    runner = llm.engine.runner
    orig, calls = runner.execute, {"n": 0}

    def execute(sched):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected failure")
        return orig(sched)
    monkeypatch.setattr(runner, "execute", execute)
    outs = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].error
    for o, ref in zip(outs[1:], reference[1:3]):
        assert o.outputs[0].token_ids == ref


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_step_does_not_leak_batch_rows(hybrid_dir, prompts, monkeypatch, async_scheduling):
    """A step that raises before the runner applied it must not lose the removals it carried: every
    row left in the input batch belongs to a live request or to one queued for removal."""
    llm = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=2, async_scheduling=async_scheduling)
    eng, runner = llm.engine, llm.engine.runner
    orig, seen = runner.execute, {"failed": None}

    def execute(sched):
        if sched.removed_req_ids and seen["failed"] is None:
            seen["failed"] = sched
            raise RuntimeError("injected failure")
        return orig(sched)
    monkeypatch.setattr(runner, "execute", execute)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 12, 5, 7, 3)]
    for _ in range(3):
        llm.generate(prompts, params, use_tqdm=False)
        live = {r.request_id for r in eng.scheduler.running}
        assert set(runner.batch.req_id_to_row) <= live | eng.scheduler._removed
    assert seen["failed"] is not None
    out = llm.generate(prompts[:2], GREEDY, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in out)


def test_loop_failure_outside_a_step_fails_streams_and_recovers(hybrid_dir, prompts, reference, monkeypatch):
    """If the loop machinery itself raises (here: the commit), every running stream ends with
    "error" instead of hanging, and the engine serves new requests afterwards."""
    eng = make(hybrid_dir)
    core = eng.engine
    orig, calls = core.commit, {"n": 0}

    def commit(handle, out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("commit exploded")
        return orig(handle, out)
    monkeypatch.setattr(core, "commit", commit)

    async def main():
        first = await asyncio.gather(*[collect(eng, p) for p in prompts[:2]])
        return first, await collect(eng, prompts[2])
    first, (toks, last) = asyncio.run(main())
    for _, lst in first:
        assert lst.outputs[0].finish_reason == "error" and "commit exploded" in lst.error
    assert toks == reference[2] and last.outputs[0].finish_reason == "length"
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    eng.shutdown()
