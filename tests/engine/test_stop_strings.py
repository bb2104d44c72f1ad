"""Stop strings (SamplingParams.stop, include_stop_str_in_output) against their definition.

Definition (written out here, the reference): with T the tokens generated without stop strings,
the request stops after the first k tokens where k is the smallest count for which the text of
T[:k] contains a stop string; the output tokens are T[:k] and the text is that text cut before
the earliest stop string in it (after it with include_stop_str_in_output). Checked for LLM and
AsyncLLM, async scheduling on and off, without spec and with every drafter, and for a stop
string that ends inside a verified run of accepted drafts.
"""
import asyncio
import os
import re

import numpy as np
import pytest

from hybrid_engine import LLM, AsyncLLM, SamplingParams, SpeculativeConfig
from continuation_drafter import ContinuationDrafter
from hybrid_engine.spec.drafters import DRAFTERS

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
ARGS = dict(dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=96)
PROMPTS = ["hello world, streaming", "the cat sat", "a b c d e", "stop here"]
MAX = 40


@pytest.fixture(scope="module")
def plain(tok_dir):
    """(tokenizer, token lists generated without stop strings)."""
    llm = LLM(tok_dir, **ARGS)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX, ignore_eos=True), use_tqdm=False)
    return llm.tokenizer, [o.outputs[0].token_ids for o in outs]


def reference(tok, toks, stops, include):
    """(tokens, text, matched stop) by the definition above; None when no stop string occurs."""
    for k in range(1, len(toks) + 1):
        text = tok.decode(toks[:k], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            i, s = min(hits)
            return toks[:k], text[:i + len(s)] if include else text[:i], s
    return None


def pick_stops(tok, toks, rng, count=1):
    """Short ASCII-letter substrings of the generated text (so the reference's cut is unambiguous)."""
    text = tok.decode(toks, skip_special_tokens=True)
    words = [m.group(0) for m in re.finditer(r"[A-Za-z]{2,3}", text[3:])]
    assert words, text
    return list(dict.fromkeys(rng.choice(words, size=min(count, len(words)), replace=False).tolist()))


def cases(tok, plain_toks, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i, toks in enumerate(plain_toks):
        stops = pick_stops(tok, toks, rng, count=1 + i % 2)
        out.append((PROMPTS[i], stops, bool(i % 2), reference(tok, toks, stops, bool(i % 2))))
    return out


def check(outs, expected):
    for o, (_, stops, include, ref) in zip(outs, expected):
        c = o.outputs[0]
        toks, text, s = ref
        assert c.token_ids == toks, (stops, include)
        assert c.text == text and c.finish_reason == "stop" and c.stop_reason == s


def generate(model, expected, spec=None, async_scheduling=False):
    llm = LLM(model, speculative_config=spec, async_scheduling=async_scheduling, **ARGS)
    params = [SamplingParams(max_tokens=MAX, ignore_eos=True, stop=stops, include_stop_str_in_output=inc)
              for _, stops, inc, _ in expected]
    outs = llm.generate([p for p, *_ in expected], params, use_tqdm=False)
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    return outs, st


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_strings_match_definition(tok_dir, plain, async_scheduling):
    tok, toks = plain
    expected = cases(tok, toks)
    assert all(len(ref[0]) < MAX for *_, ref in expected)
    outs, _ = generate(tok_dir, expected, async_scheduling=async_scheduling)
    check(outs, expected)


@pytest.mark.parametrize("method,k,async_scheduling", [("ngram", 3, True), ("draft_model", 2, False),
                                                       ("mtp", 3, True)])
def test_stop_strings_with_spec_equal_no_spec(tok_dir, plain, method, k, async_scheduling):
    tok, toks = plain
    expected = cases(tok, toks, seed=1)
    spec = SpeculativeConfig(method, k, model=str(tok_dir) if method == "draft_model" else None)
    outs, st = generate(tok_dir, expected, spec, async_scheduling)
    check(outs, expected)
    if method == "draft_model":                 # the target drafts for itself: every draft accepted
        assert st["drafts_accepted"] > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stop_inside_a_run_of_accepted_drafts(tok_dir, plain, monkeypatch, async_scheduling):
    """K = 3 with perfect drafts: outputs come as 1 (prefill), then runs of 4. A stop string whose
    last token is in the middle of a run cuts the output at exactly that token, the request ends
    and its slot and blocks are free."""
    tok, toks = plain
    k = 3
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    seqs = {f"r{i}": prompt_ids[i] + toks[i] for i in range(len(PROMPTS))}
    monkeypatch.setitem(DRAFTERS, "ngram", lambda build: ContinuationDrafter(build.num_spec, seqs))
    # for each prompt: a stop string whose first occurrence completes at a mid-run token
    chosen = []
    for i, t in enumerate(toks):
        for m in re.finditer(r"[A-Za-z]{2}", tok.decode(t, skip_special_tokens=True)):
            ref = reference(tok, t, [m.group(0)], False)
            if ref is not None and (len(ref[0]) - 1) % (1 + k) not in (0,) and len(ref[0]) > 1:
                chosen.append((i, m.group(0), ref))
                break
    assert len(chosen) >= 2
    llm = LLM(tok_dir, speculative_config=SpeculativeConfig("ngram", k), async_scheduling=async_scheduling, **ARGS)
    eng = llm.engine
    reqs = [eng.make_request(PROMPTS[i], SamplingParams(max_tokens=MAX, ignore_eos=True, stop=[s]), f"r{i}")
            for i, s, _ in chosen]
    for r in reqs:
        eng.add_request(r)
    while eng.has_work():
        eng.step()
    for r, (i, s, ref) in zip(reqs, chosen):
        assert r.output_token_ids == ref[0] and r.finish_reason == "stop"
        assert r.metrics.drafts_accepted == r.metrics.drafts_proposed > 0     # every run complete
        assert eng.make_output(r).outputs[0].text == ref[1]
    occ = eng.occupancy()
    assert occ["free_slots"] == occ["total_slots"] and occ["free_blocks"] == occ["total_blocks"]


def test_async_llm_streams_the_cut_text(tok_dir, plain):
    """Deltas never show a stop string (nor text after it); joined they equal the reference."""
    tok, toks = plain
    expected = cases(tok, toks, seed=2)
    eng = AsyncLLM(tok_dir, async_scheduling=True, **ARGS)

    async def one(prompt, stops, include):
        parts, last = [], None
        async for out in eng.generate(prompt, SamplingParams(max_tokens=MAX, ignore_eos=True, stop=stops,
                                                             include_stop_str_in_output=include)):
            parts.append(out.outputs[0].text)
            last = out
        return "".join(parts), last

    async def main():
        return await asyncio.gather(*(one(p, s, inc) for p, s, inc, _ in expected))
    results = asyncio.run(main())
    for (text, last), (_, stops, include, ref) in zip(results, expected):
        assert text == ref[1] and last.outputs[0].finish_reason == "stop"
        assert last.outputs[0].stop_reason == ref[2]
    eng.shutdown()


def test_stop_validation(tok_dir, hybrid_dir):
    with pytest.raises(TypeError, match="SamplingParams.stop"):
        SamplingParams(stop=[1, 2])
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        SamplingParams(stop=["ok", ""])
    with pytest.raises(TypeError, match="include_stop_str_in_output"):
        SamplingParams(stop="x", include_stop_str_in_output=1)
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(stop=None).stop == ()
    llm = LLM(hybrid_dir, **ARGS)                   # no tokenizer: stop strings cannot be read
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        llm.generate([[5, 6]], SamplingParams(stop="x"), use_tqdm=False)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
