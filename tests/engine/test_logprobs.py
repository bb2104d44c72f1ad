"""SamplingParams.logprobs against its definition: log_softmax of the target's logits after the
request's logits processing (transformers float32 logits + the processing definition written out
in test_logits_processing.py), top-N descending; the same under every drafter and async
scheduling, through LLM and AsyncLLM, and cut with the tokens by a stop string."""
import asyncio
import os

import pytest
import torch

from hf_reference import hf_logits
from hybrid_engine import LLM, AsyncLLM, SamplingParams, SpeculativeConfig
from test_logits_processing import reference as processed

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
ARGS = dict(dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=96)
PROMPTS = ["a b a b a b a b", "the cat the cat the cat", "hello"]
N = 3
PARAMS = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=N),
          SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1, repetition_penalty=1.5, presence_penalty=0.7,
                         logit_bias={9: 1.5}),
          SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)]


@pytest.fixture(scope="module")
def plain(tok_dir):
    llm = LLM(tok_dir, **ARGS)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return llm.tokenizer, [o.outputs[0] for o in outs]


def test_logprobs_match_definition(tok_dir, plain):
    tok, outs = plain
    for prompt, p, out in zip(PROMPTS, PARAMS, plain[1]):
        ids = tok.encode(prompt, add_special_tokens=False)
        assert len(out.logprobs) == len(out.token_ids)
        for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            x = processed(hf_logits(tok_dir, ids + out.token_ids[:i])[-1], ids, out.token_ids[:i],
                          bias=p.logit_bias, repetition=p.repetition_penalty, presence=p.presence_penalty)
            ref = torch.log_softmax(x, -1)
            top = ref.topk(p.logprobs)
            want = {t: float(ref[t]), **{int(j): float(v) for v, j in zip(top.values, top.indices)
                                         if int(j) != t}}
            assert list(lp)[0] == t and set(lp) == set(want)
            for j, v in want.items():
                assert lp[j] == pytest.approx(v, abs=2e-4)
            assert list(lp.values())[1:] == sorted(list(lp.values())[1:], reverse=True)


@pytest.mark.parametrize("method,k,async_scheduling", [(None, 0, True), ("ngram", 3, True),
                                                       ("draft_model", 2, False), ("mtp", 2, True)])
def test_logprobs_equal_under_spec_and_async(tok_dir, plain, method, k, async_scheduling):
    spec = None if method is None else SpeculativeConfig(method, k, model=str(tok_dir) if method == "draft_model"
                                                         else None)
    llm = LLM(tok_dir, speculative_config=spec, async_scheduling=async_scheduling, **ARGS)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for o, ref in zip(outs, plain[1]):
        c = o.outputs[0]
        assert c.token_ids == ref.token_ids
        assert [list(d) for d in c.logprobs] == [list(d) for d in ref.logprobs]
        for d, r in zip(c.logprobs, ref.logprobs):
            assert list(d.values()) == pytest.approx(list(r.values()), abs=1e-4)


def test_logprobs_stream_and_stop(tok_dir, plain):
    """AsyncLLM deltas carry the logprobs of their tokens; a stop string cuts both alike."""
    tok, outs = plain
    text = tok.decode(outs[0].token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    eng = AsyncLLM(tok_dir, async_scheduling=True, **ARGS)

    async def run(p):
        toks, lps = [], []
        async for out in eng.generate(PROMPTS[0], p):
            toks += out.outputs[0].token_ids
            lps += out.outputs[0].logprobs
        return toks, lps
    toks, lps = asyncio.run(run(PARAMS[0]))
    assert toks == outs[0].token_ids and [list(d) for d in lps] == [list(d) for d in outs[0].logprobs]
    import dataclasses
    toks, lps = asyncio.run(run(dataclasses.replace(PARAMS[0], stop=[stop])))
    eng.shutdown()
    assert 0 < len(toks) < len(outs[0].token_ids) and len(lps) == len(toks)
    assert [list(d) for d in lps] == [list(d) for d in outs[0].logprobs[:len(toks)]]


def test_logprobs_validation():
    for bad, exc in [(21, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)]:
        with pytest.raises(exc, match="SamplingParams.logprobs"):
            SamplingParams(logprobs=bad)
