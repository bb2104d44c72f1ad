"""AsyncLLM: streamed deltas equal LLM.generate / transformers, concurrency, abort, ids, shutdown
and consumer-side cleanup (step failures: test_async_failures.py). Each test drives its own event
loop with asyncio.run."""
import asyncio
import contextlib
import gc

import pytest

from async_llm_helpers import (DEV, GREEDY, MAX_TOKENS, collect, make, prompts,  # noqa: F401
                               reference, wait_until)
from hybrid_engine import LLM, AsyncLLM, SamplingParams


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
            with pytest.raises((ValueError, TypeError), match=words):
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
                assert eng.engine.inflight is not None          # a step carrying "x" is in flight
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
