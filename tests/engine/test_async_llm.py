"""AsyncLLM: streamed deltas equal LLM.generate / transformers, concurrency, abort, ids, shutdown,
step failures and consumer-side cleanup. Each test drives its own event loop with asyncio.run."""
import asyncio
import contextlib
import gc
import os

import numpy as np
import pytest

from hybrid_engine import LLM, AsyncLLM, SamplingParams
from hybrid_engine.testing import hf_greedy

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, n).tolist() for n in (3, 17, 40, 1, 9)]


@pytest.fixture(scope="module")
def reference(hybrid_dir, prompts):
    return hf_greedy(hybrid_dir, prompts, max_new_tokens=MAX_TOKENS)


def make(hybrid_dir, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEV)
    return AsyncLLM(hybrid_dir, **kw)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


async def collect(engine, prompt, params=GREEDY, request_id=None, outs=None):
    """All deltas of one stream; returns (tokens, last output)."""
    toks, last = [], None
    async for out in engine.generate(prompt, params, request_id=request_id):
        assert last is None or not last.finished, "nothing may follow the finished output"
        if outs is not None:
            outs.append(out)
        toks += out.outputs[0].token_ids
        last = out
    return toks, last


async def wait_until(cond, timeout=30.0):
    t0 = asyncio.get_running_loop().time()
    while not cond():
        assert asyncio.get_running_loop().time() - t0 < timeout, "timed out"
        await asyncio.sleep(0.001)


# ---------------------------------------------------------------------------------------- streams

@pytest.mark.parametrize("async_scheduling", [True, False])
def test_concurrent_streams_equal_llm_and_transformers(hybrid_dir, prompts, reference, async_scheduling):
    # small budget: chunked prefill of the 40-token prompt while the others decode
    eng = make(hybrid_dir, max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    llm_out = LLM(hybrid_dir, dtype="float32", device=DEV, async_scheduling=async_scheduling).generate(
        prompts, GREEDY, use_tqdm=False)

    async def main():
        all_outs = [[] for _ in prompts]
        res = await asyncio.gather(*[collect(eng, p, request_id=f"r{i}", outs=all_outs[i])
                                     for i, p in enumerate(prompts)])
        return res, all_outs
    res, all_outs = asyncio.run(main())
    for (toks, last), outs, lo, ref in zip(res, all_outs, llm_out, reference):
        assert toks == lo.outputs[0].token_ids == ref
        assert last.finished and last.outputs[0].finish_reason == "length" and last.error is None
        assert all(not o.finished and o.outputs[0].finish_reason is None for o in outs[:-1])
        assert all(o.outputs[0].token_ids for o in outs[:-1])          # no empty deltas mid-stream
        assert len(outs) > 1                                             # it really streamed
    assert len({o.request_id for outs in all_outs for o in outs}) == len(prompts)
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    assert not eng.engine.scheduler.requests                             # finished requests are forgotten
    eng.shutdown()


def test_seeded_streams_equal_llm(hybrid_dir, prompts):
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    ref = LLM(hybrid_dir, dtype="float32", device=DEV).generate(prompts, params, use_tqdm=False)
    eng = make(hybrid_dir, max_num_seqs=3)

    async def main():
        return await asyncio.gather(*[collect(eng, p, sp) for p, sp in zip(prompts, params)])
    for (toks, _), r in zip(asyncio.run(main()), ref):
        assert toks == r.outputs[0].token_ids
    eng.shutdown()


def test_request_arriving_while_others_run(hybrid_dir, prompts, reference):
    eng = make(hybrid_dir)
    long_params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def main():
        first_tokens = []
        gen = eng.generate(prompts[0], long_params, request_id="early")
        early = []
        async for out in gen:
            early += out.outputs[0].token_ids
            if len(early) >= 3:
                break
        # the late request joins a running batch; the early one keeps streaming
        late_task = asyncio.create_task(collect(eng, prompts[1], request_id="late"))
        async for out in gen:
            early += out.outputs[0].token_ids
            first_tokens.append(late_task.done())
        late, _ = await late_task
        return early, late, first_tokens
    early, late, first_tokens = asyncio.run(main())
    assert early == reference[0] and late == reference[1]
    assert not all(first_tokens)                 # the late request ran while the early one did
    eng.shutdown()


def test_text_streaming_with_tokenizer(model_dirs):
    d = model_dirs("tok", pattern="M*-", vocab_size=300, with_tokenizer=True, seed=2)
    eng = AsyncLLM(d, dtype="float32", device=DEV)
    tok = eng.tokenizer

    async def main():
        outs = []
        toks, last = await collect(eng, "hello world, streaming", SamplingParams(max_tokens=16, ignore_eos=True),
                                   outs=outs)
        return toks, outs
    toks, outs = asyncio.run(main())
    assert "".join(o.outputs[0].text for o in outs) == tok.decode(toks, skip_special_tokens=True)
    eng.shutdown()


# ----------------------------------------------------------------------------------- ids / abort

def test_validation_errors_before_anything_is_queued(hybrid_dir):
    eng = make(hybrid_dir, max_model_len=64)

    async def main():
        for prompt, params, words in [([], None, "empty"), ([5, 999], None, "vocabulary"),
                                      ("text", None, "tokenizer"), ([5], "greedy", "SamplingParams")]:
            with pytest.raises(ValueError, match=words):
                async for _ in eng.generate(prompt, params):
                    pass
            assert not eng.engine.has_work() and not eng._streams
        with pytest.raises(ValueError, match="max_tokens"):
            SamplingParams(max_tokens=0)
        return await collect(eng, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    toks, last = asyncio.run(main())
    assert len(toks) == 3 and last.outputs[0].finish_reason == "length"
    eng.shutdown()


def test_duplicate_live_id_and_unknown_abort(hybrid_dir, prompts, reference):
    eng = make(hybrid_dir)

    async def main():
        assert await eng.abort("nobody") is False
        task = asyncio.create_task(collect(eng, prompts[0], request_id="dup"))
        await wait_until(lambda: "dup" in eng._streams)
        with pytest.raises(ValueError, match="already in use"):
            async for _ in eng.generate(prompts[1], GREEDY, request_id="dup"):
                pass
        first, _ = await task
        assert await eng.abort("dup") is False                  # finished: unknown now, no error
        again, _ = await collect(eng, prompts[1], request_id="dup")   # the id is free again
        return first, again
    first, again = asyncio.run(main())
    assert first == reference[0] and again == reference[1]
    eng.shutdown()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_abort_mid_stream(hybrid_dir, prompts, reference, async_scheduling):
    eng = make(hybrid_dir, async_scheduling=async_scheduling)
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        victim_outs = []

        async def victim():
            return await collect(eng, prompts[2], long, request_id="victim", outs=victim_outs)
        vt = asyncio.create_task(victim())
        other = asyncio.create_task(collect(eng, prompts[1], request_id="other"))
        await wait_until(lambda: sum(len(o.outputs[0].token_ids) for o in victim_outs) >= 3)
        assert await eng.abort("victim") is True
        assert await eng.abort("victim") is False
        toks, last = await vt
        return toks, last, await other
    toks, last, (other, other_last) = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert 3 <= len(toks) < 200
    assert other == reference[1] and other_last.outputs[0].finish_reason == "length"
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    eng.shutdown()


def test_reusing_an_id_while_its_old_step_is_in_flight(hybrid_dir, prompts, reference):
    """Abort "x" right after a step carrying it was launched, then start a new "x" at once: the old
    step's output must not be committed to the new request (epochs are unique per admission)."""
    eng = make(hybrid_dir, async_scheduling=True)
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        gen = eng.generate(prompts[2], long, request_id="x")
        n = 0
        async for out in gen:
            n += len(out.outputs[0].token_ids)
            if n >= 2:
                assert eng.engine._inflight is not None          # a step carrying "x" is in flight
                assert await eng.abort("x")
                break
        await gen.aclose()
        return await collect(eng, prompts[3], request_id="x")
    toks, last = asyncio.run(main())
    assert toks == reference[3] and last.outputs[0].finish_reason == "length"
    eng.shutdown()


@pytest.mark.parametrize("how", ["break", "aclosing", "cancel"])
def test_consumer_that_stops_aborts_its_request(hybrid_dir, prompts, reference, how):
    eng = make(hybrid_dir)
    long = SamplingParams(max_tokens=500, ignore_eos=True)

    async def main():
        async def consume():
            n = 0
            if how == "aclosing":
                async with contextlib.aclosing(eng.generate(prompts[2], long, request_id="gone")) as gen:
                    async for out in gen:
                        n += len(out.outputs[0].token_ids)
                        if n >= 2:
                            break
                return
            async for out in eng.generate(prompts[2], long, request_id="gone"):
                n += len(out.outputs[0].token_ids)
                if n >= 2 and how == "break":
                    break
        task = asyncio.create_task(consume())
        other = asyncio.create_task(collect(eng, prompts[0], request_id="other"))
        if how == "cancel":
            await wait_until(lambda: "gone" in eng._streams and len(eng._streams["gone"].req.output_token_ids) >= 2)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        gc.collect()
        await wait_until(lambda: "gone" not in eng.engine.scheduler.requests)
        assert "gone" not in eng._streams
        assert await eng.abort("gone") is False
        return await other
    toks, _ = asyncio.run(main())
    assert toks == reference[0]
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    eng.shutdown()


def test_shutdown(hybrid_dir, prompts):
    eng = make(hybrid_dir)

    async def main():
        outs = []
        task = asyncio.create_task(collect(eng, prompts[0], SamplingParams(max_tokens=300, ignore_eos=True),
                                           request_id="live", outs=outs))
        await wait_until(lambda: outs)
        eng.shutdown()
        toks, last = await task
        assert last.finished and last.outputs[0].finish_reason == "abort"
        assert not eng.is_running
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in eng.generate(prompts[1], GREEDY):
                pass
        assert await eng.abort("live") is False
        eng.shutdown()                                     # idempotent
    asyncio.run(main())


def test_reused_across_event_loops(hybrid_dir, prompts, reference):
    eng = make(hybrid_dir)
    for i in (0, 1):
        toks, _ = asyncio.run(collect(eng, prompts[i]))
        assert toks == reference[i]
    eng.shutdown()


# --------------------------------------------------------------------------------------- failures

@pytest.mark.parametrize("where", ["before", "inside"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_failed_step_fails_only_its_requests(hybrid_dir, prompts, reference, monkeypatch, where,
                                             async_scheduling):
    """Step 3 raises (before the runner touched anything, or inside the forward): the two requests in
    it end with finish_reason "error"; the queued one (max_num_seqs=2) and later ones succeed."""
    eng = make(hybrid_dir, max_num_seqs=2, async_scheduling=async_scheduling)
    runner = eng.engine.runner
    calls = {"n": 0, "in_failed": None}
    orig_execute, orig_forward = runner.execute, runner.model.forward

    def execute(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            calls["in_failed"] = {r.req_id for r in sched.rows}
            if where == "before":
                raise RuntimeError("injected failure")
            runner.model.forward = boom
            try:
                return orig_execute(sched)
            finally:
                runner.model.forward = orig_forward
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
