"""SamplingParams.n > 1: the samples share one prefill (the leader's Mamba state and KV copied into
each sibling's slot and blocks, scheduling/fork.py) and equal what n separate requests give.

Reference: sample i of a seeded request equals a plain request with seed + i, prefilled on its
own (so a forked state that differed from a recomputed one would show); greedy samples equal
transformers' greedy. The prompt is computed once: the group's prefill rows carry P - 1 + n
tokens, not n * P."""
import os

import numpy as np
import pytest

from hf_reference import hf_greedy
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.step import runner as runner_mod

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
ARGS = dict(dtype="float32", device=DEV, max_num_seqs=6, max_num_batched_tokens=12, block_size=4, num_kv_blocks=128)


@pytest.fixture(scope="module")
def model(model_dirs):
    return model_dirs("small_mtp", pattern="M-M*-", vocab_size=300, seed=2, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(8)
    return [rng.integers(3, 256, n).tolist() for n in (19, 1, 7)]


def sampled(seed):
    return SamplingParams(max_tokens=7, temperature=1.0, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def separate(model, prompts):
    """Each sample as its own request (seed + i), each with its own prefill."""
    llm = LLM(model, **ARGS)
    outs = llm.generate([p for p in prompts for _ in range(3)], [sampled(10 * j + i) for j in range(3) for i in range(3)],
                        use_tqdm=False)
    toks = [o.outputs[0].token_ids for o in outs]
    return [toks[3 * j:3 * j + 3] for j in range(3)]


class _Spy:
    """Records every scheduled row and every fork copy."""

    def __init__(self, llm, monkeypatch):
        self.rows, self.forks = [], []
        sched = llm.engine.scheduler
        orig = sched.schedule

        def schedule():
            out = orig()
            self.rows += [(r.req_id, r.num_tokens, r.is_decode) for r in out.rows]
            return out
        monkeypatch.setattr(sched, "schedule", schedule)
        real = runner_mod.fork_state
        monkeypatch.setattr(runner_mod, "fork_state",
                            lambda caches, fork, slot: (self.forks.append((fork, slot)), real(caches, fork, slot)))

    def prefill_tokens(self, prefix):
        return sum(n for rid, n, dec in self.rows if not dec and rid.split("#")[0] == prefix)


@pytest.mark.parametrize("spec,async_scheduling", [(None, False), (None, True), (SpeculativeConfig("ngram", 2), True)])
def test_samples_equal_separate_requests_and_share_the_prefill(model, prompts, separate, monkeypatch, spec,
                                                               async_scheduling):
    llm = LLM(model, speculative_config=spec, async_scheduling=async_scheduling, **ARGS)
    spy = _Spy(llm, monkeypatch)
    params = [SamplingParams(max_tokens=7, temperature=1.0, seed=10 * j, ignore_eos=True, n=3) for j in range(3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, ref in zip(outs, separate):
        assert [c.index for c in o.outputs] == [0, 1, 2] and o.finished
        assert [c.token_ids for c in o.outputs] == ref
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    for o, p in zip(outs, prompts):
        assert spy.prefill_tokens(o.request_id) == (len(p) - 1 + 3 if len(p) >= 2 else 3 * len(p))
    assert len(spy.forks) == 2 * sum(len(p) >= 2 for p in prompts)


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("mtp", 2)])
def test_greedy_samples_equal_transformers(model, prompts, spec):
    """Greedy, also with MTP (whose samples prefill separately: its own caches are not forked)."""
    llm = LLM(model, async_scheduling=True, speculative_config=spec, **ARGS)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, n=2), use_tqdm=False)
    ref = hf_greedy(model, prompts, max_new_tokens=6)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[r, r] for r in ref]


def test_group_waits_for_room_and_others_keep_running(model, prompts, separate):
    """max_num_seqs 4: a group of 3 beside two running requests waits at its fork until enough
    slots are free (nobody else is admitted meanwhile); everything finishes, nothing leaks."""
    llm = LLM(model, **{**ARGS, "max_num_seqs": 4})
    outs = llm.generate([prompts[2], prompts[2], prompts[0]],
                        [sampled(20), sampled(21), SamplingParams(max_tokens=7, temperature=1.0, seed=0, n=3,
                                                                  ignore_eos=True)], use_tqdm=False)
    assert [c.token_ids for c in outs[2].outputs] == separate[0]
    assert outs[0].outputs[0].token_ids == separate[2][0] and outs[1].outputs[0].token_ids == separate[2][1]
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]


def test_abort_before_the_fork(model, prompts, separate):
    """Aborting the leader before the fork lets its siblings run as ordinary requests; aborting a
    waiting sibling takes it out of its group."""
    llm = LLM(model, **ARGS)
    eng = llm.engine
    group = eng.make_requests(prompts[0], SamplingParams(max_tokens=7, temperature=1.0, seed=0, n=3,
                                                         ignore_eos=True), "g")
    eng.add_requests(group)
    eng.step()                                       # the leader's first chunk
    assert group[0].fork_pending and not group[1].finished
    assert eng.abort("g#2") and group[2].finish_reason == "abort"
    assert eng.abort("g")
    while eng.has_work():
        eng.step()
    assert group[1].output_token_ids == separate[0][1]
    occ = eng.occupancy()
    assert occ["free_slots"] == occ["total_slots"] and occ["free_blocks"] == occ["total_blocks"]


def test_n_validation(model):
    for bad, exc in [(0, ValueError), (1.5, TypeError), (True, TypeError)]:
        with pytest.raises(exc, match="SamplingParams.n"):
            SamplingParams(n=bad)
    llm = LLM(model, **ARGS)
    with pytest.raises(ValueError, match="SamplingParams.n=7"):
        llm.generate([[5, 6]], SamplingParams(n=7), use_tqdm=False)
    assert len(llm.generate([[5, 6]], SamplingParams(n=2, max_tokens=2), use_tqdm=False)[0].outputs) == 2


def test_async_llm_streams_the_samples(model, prompts, separate):
    """AsyncLLM: deltas name their sample by index; joined per index they equal the separate
    requests; abort ends every sample."""
    import asyncio
    from hybrid_engine import AsyncLLM
    eng = AsyncLLM(model, async_scheduling=True, **ARGS)

    async def main():
        got = {0: [], 1: [], 2: []}
        last = None
        async for out in eng.generate(prompts[0], SamplingParams(max_tokens=7, temperature=1.0, seed=0, n=3,
                                                                  ignore_eos=True), "a"):
            for c in out.outputs:
                got[c.index] += c.token_ids
            last = out
        aborted = []
        async for out in eng.generate(prompts[2], SamplingParams(max_tokens=50, n=2, ignore_eos=True), "b"):
            aborted.append(out)
            if len(aborted) == 1:
                await eng.abort("b")
        return got, last, aborted
    got, last, aborted = asyncio.run(main())
    eng.shutdown()
    assert [got[i] for i in range(3)] == separate[0] and last.finished and last.request_id == "a"
    assert aborted[-1].finished
    st = eng.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
