"""SamplingParams.prompt_logprobs against its definition: for prompt position p >= 1,
log_softmax(transformers float32 logits at p - 1)[prompt[p]] and the top-N there (None at p = 0).
With chunked prefill (small token budgets, several chunks per prompt), beside decode and verify
rows of other requests (the chunk's tokens sit after theirs in the step), async on and off,
with speculation, and through AsyncLLM's first output."""
import asyncio
import os

import numpy as np
import pytest
import torch

from hf_reference import hf_logits
from hybrid_engine import LLM, AsyncLLM, SamplingParams, SpeculativeConfig

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def model(model_dirs):
    return model_dirs("small_mtp", pattern="M-M*-", vocab_size=300, seed=2, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(3, 256, n).tolist() for n in (19, 1, 9, 23)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    out = []
    for p in prompts:
        lp = torch.log_softmax(hf_logits(model, p), -1)             # [T, V]
        out.append([None] + [(float(lp[i - 1, p[i]]), lp[i - 1].topk(2)) for i in range(1, len(p))])
    return out


def check(got, ref, prompt, n):
    assert len(got) == len(prompt) and got[0] is None
    for pos in range(1, len(prompt)):
        want_lp, top = ref[pos]
        d = got[pos]
        assert list(d)[0] == prompt[pos] and d[prompt[pos]] == pytest.approx(want_lp, abs=2e-4)
        want = {int(i): float(v) for v, i in zip(top.values[:n], top.indices[:n])}
        for i, v in want.items():
            assert d[i] == pytest.approx(v, abs=2e-4)
        assert set(d) == set(want) | {prompt[pos]}


@pytest.mark.parametrize("spec,async_scheduling,budget", [(None, False, 8), (SpeculativeConfig("ngram", 2), True, 7),
                                                          (SpeculativeConfig("mtp", 2), False, 9)])
def test_prompt_logprobs_match_transformers(model, prompts, reference, spec, async_scheduling, budget):
    llm = LLM(model, dtype="float32", device=DEV, max_num_seqs=3, max_num_batched_tokens=budget, block_size=4,
              num_kv_blocks=96, speculative_config=spec, async_scheduling=async_scheduling)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=n) for n in (2, 0, None, 1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p, sp, ref in zip(outs, prompts, params, reference):
        if sp.prompt_logprobs is None:
            assert o.prompt_logprobs is None
        else:
            check(o.prompt_logprobs, ref, p, sp.prompt_logprobs)
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]


def test_prompt_logprobs_are_computed_even_when_the_prompt_is_cached(model, prompts, reference):
    """Prefix caching (on by default) never serves a prompt-logprobs request from the cache: every
    position needs its logits. The same prompts sent again give the same complete logprobs, with no
    cached tokens, while a plain request for a prompt already seen does hit."""
    llm = LLM(model, dtype="float32", device=DEV, max_num_seqs=3, max_num_batched_tokens=8, block_size=4,
              num_kv_blocks=96, mamba_checkpoint_interval=1)
    sp = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=2, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([prompts[0], prompts[3]], sp, use_tqdm=False)
        for o, i in zip(outs, (0, 3)):
            assert o.num_cached_tokens == 0
            check(o.prompt_logprobs, reference[i], prompts[i], 1)
    assert llm.generate([prompts[3]], plain, use_tqdm=False)[0].num_cached_tokens > 0


def test_prompt_logprobs_async_llm_first_output(model, prompts, reference):
    eng = AsyncLLM(model, dtype="float32", device=DEV, max_num_batched_tokens=6, block_size=4, num_kv_blocks=64)

    async def main():
        outs = []
        async for out in eng.generate(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=2)):
            outs.append(out)
        return outs
    outs = asyncio.run(main())
    eng.shutdown()
    check(outs[0].prompt_logprobs, reference[0], prompts[0], 2)
    assert all(o.prompt_logprobs is None for o in outs[1:])


def test_prompt_logprobs_validation():
    for bad, exc in [(21, ValueError), (-1, ValueError), ("1", TypeError)]:
        with pytest.raises(exc, match="SamplingParams.prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
