"""The OpenAI-compatible API, end to end: the official ``openai`` client and raw httpx against a real
server process (``openai_case.py``). Greedy tokens through the server must equal ``AsyncLLM`` run
directly (without speculation) on the same prompt. Metrics, disconnects and load:
``test_openai_load.py``."""
import asyncio

import httpx
import openai
import pytest

from openai_case import GREEDY, KEY, MAX_TOKENS, PROMPTS, _chat_ids, direct  # noqa: F401 (fixture)
from server_harness import client
from hybrid_engine import AsyncLLM, SamplingParams


def test_models_and_health(server, oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == ["default"]
    h = httpx.get(server.url + "/health").json()           # no key needed for probes
    assert h["status"] == "ok" and h["total_blocks"] > 0 and h["total_slots"] == 16


def test_api_key_required(server):
    bad = client(server, "wrong-key")
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model="default", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.get(server.url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200


def test_completion_equals_async_llm(oai, direct):
    r = oai.completions.create(model="default", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, **GREEDY)
    ref = direct.run([PROMPTS[0]])[0][:MAX_TOKENS]
    c = r.choices[0]
    assert c.token_ids == ref and c.finish_reason == "length"
    assert c.text == direct.tokenizer.decode(ref, skip_special_tokens=True)
    prompt_ids = direct.tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    assert c.prompt_token_ids == prompt_ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt_ids), MAX_TOKENS, len(prompt_ids) + MAX_TOKENS)
    assert r.object == "text_completion" and r.model == "default"


def test_completion_default_max_tokens(server, direct):
    """OpenAI's default of 16 tokens, also for an explicit null; the prompt echoed as token ids."""
    ref = direct.run([PROMPTS[2]])[0][:16]
    for extra in ({}, {"max_tokens": None}):
        r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"model": "default", "prompt": PROMPTS[2], "temperature": 0, "ignore_eos": True,
                             "return_token_ids": True, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == ref and r.json()["usage"]["completion_tokens"] == 16


def test_completion_token_prompt_and_stream(oai, direct):
    ids = direct.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    ref = direct.run([ids])[0][:MAX_TOKENS]
    chunks = list(oai.completions.create(model="default", prompt=ids, max_tokens=MAX_TOKENS, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    body, usage = chunks[:-1], chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == MAX_TOKENS
    assert usage.usage.prompt_tokens == len(ids)
    assert all(ch.usage is None for ch in body)
    assert sum((ch.choices[0].token_ids for ch in body), []) == ref
    assert "".join(ch.choices[0].text for ch in body) == direct.tokenizer.decode(ref, skip_special_tokens=True)
    assert [ch.choices[0].finish_reason for ch in body] == [None] * (len(body) - 1) + ["length"]
    # without include_usage no usage chunk comes
    plain = list(oai.completions.create(model="default", prompt=ids, max_tokens=3, stream=True, **GREEDY))
    assert all(ch.choices and ch.usage is None for ch in plain)


def _stop_reference(tok, toks, stops, include=False):
    """The stop-string definition: the first k tokens whose text holds a stop string; the text
    cut before the earliest one (after it with include)."""
    for k in range(1, len(toks) + 1):
        text = tok.decode(toks[:k], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            i, s = min(hits)
            return toks[:k], (text[:i + len(s)] if include else text[:i]), s
    raise AssertionError(f"no stop string of {stops} in the reference")


def test_stop_strings(oai, direct):
    """stop (completions and chat, whole and streamed, include_stop_str_in_output) against the
    definition on the greedy reference; the server runs n-gram spec, so a cut may fall inside a
    verified run of drafts."""
    tok = direct.tokenizer
    ref = direct.run([PROMPTS[4]])[0]
    text = tok.decode(ref, skip_special_tokens=True)
    stops = [text[len(text) // 2:len(text) // 2 + 2], "\u00ff\u00fe"]
    toks, cut, s = _stop_reference(tok, ref, stops)
    r = oai.completions.create(model="default", prompt=PROMPTS[4], max_tokens=16, stop=stops, **GREEDY)
    c = r.choices[0]
    assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (toks, cut, "stop", s)
    assert r.usage.completion_tokens == len(toks)
    chunks = list(oai.completions.create(model="default", prompt=PROMPTS[4], max_tokens=16, stop=stops,
                                         stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert sum((ch.choices[0].token_ids for ch in chunks), []) == toks
    assert chunks[-1].choices[0].finish_reason == "stop"
    g = dict(GREEDY, extra_body={**GREEDY["extra_body"], "include_stop_str_in_output": True})
    toks, cut, s = _stop_reference(tok, ref, stops[:1], include=True)
    r = oai.completions.create(model="default", prompt=PROMPTS[4], max_tokens=16, stop=stops[0], **g)
    assert (r.choices[0].token_ids, r.choices[0].text) == (toks, cut) and cut.endswith(s)
    msgs = [{"role": "user", "content": PROMPTS[5]}]
    ids = _chat_ids(direct, msgs)
    ref = direct.run([ids])[0]
    text = tok.decode(ref, skip_special_tokens=True)
    stops = [text[5:7]]
    toks, cut, s = _stop_reference(tok, ref, stops)
    r = oai.chat.completions.create(model="default", messages=msgs, max_tokens=16, stop=stops, **GREEDY)
    c = r.choices[0]
    assert (c.token_ids, c.message.content, c.finish_reason) == (toks, cut, "stop")
    chunks = list(oai.chat.completions.create(model="default", messages=msgs, max_tokens=16, stop=stops,
                                              stream=True, **GREEDY))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == cut


def test_penalties_and_logit_bias(oai, direct):
    """presence/frequency/repetition penalties, logit_bias, min_tokens and bad_words reach the
    engine: the server's tokens equal AsyncLLM's with the same SamplingParams; a +100 bias makes
    its token the greedy choice everywhere (the definition: bias added to the logits)."""
    r = oai.completions.create(model="default", prompt=PROMPTS[7], max_tokens=6, logit_bias={"42": 100}, **GREEDY)
    assert r.choices[0].token_ids == [42] * 6
    extra = {"repetition_penalty": 2.0, "min_tokens": 3, "bad_words": ["off"]}   # "off": its first token
    sp = SamplingParams(max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0,
                        logit_bias={7: 3.0}, **extra)

    async def solo():
        llm = AsyncLLM(None, device="cpu", dtype="float32")
        toks = []
        async for out in llm.generate(PROMPTS[6], sp):
            toks += out.outputs[0].token_ids
        llm.shutdown()
        return toks
    ref = asyncio.run(solo())
    r = oai.completions.create(model="default", prompt=PROMPTS[6], max_tokens=10, presence_penalty=1.5,
                               frequency_penalty=1.0, logit_bias={"7": 3.0}, temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    assert r.choices[0].token_ids == ref and ref != direct.run([PROMPTS[6]])[0][:10]


def _engine_logprobs(prompt, n):
    """(tokens, logprobs) of AsyncLLM run directly, greedy, logprobs=n."""
    async def solo():
        llm = AsyncLLM(None, device="cpu", dtype="float32")
        toks, lps = [], []
        async for out in llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=n)):
            toks += out.outputs[0].token_ids
            lps += out.outputs[0].logprobs
        llm.shutdown()
        return toks, lps
    return asyncio.run(solo())


def test_logprobs(oai, direct):
    """completions logprobs=N and chat logprobs/top_logprobs carry the engine's values (the engine's
    logprobs are checked against their definition in tests/engine/test_logprobs.py), whole and
    streamed, in the OpenAI shapes."""
    tok = direct.tokenizer
    toks, lps = _engine_logprobs(PROMPTS[0], 2)
    r = oai.completions.create(model="default", prompt=PROMPTS[0], max_tokens=8, logprobs=2, **GREEDY)
    lp = r.choices[0].logprobs
    assert r.choices[0].token_ids == toks
    assert lp.tokens == [tok.decode([t]) for t in toks]
    assert lp.token_logprobs == pytest.approx([d[t] for d, t in zip(lps, toks)], abs=1e-5)
    for top, d in zip(lp.top_logprobs, lps):
        best = sorted(d.values(), reverse=True)[:2]
        assert sorted(top.values(), reverse=True)[:2] == pytest.approx(best, abs=1e-5)
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chunks = list(oai.completions.create(model="default", prompt=PROMPTS[0], max_tokens=8, logprobs=2, stream=True,
                                         **GREEDY))
    streamed = sum((ch.choices[0].logprobs.token_logprobs for ch in chunks if ch.choices[0].logprobs), [])
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-5)
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    ids = _chat_ids(direct, msgs)
    toks, lps = _engine_logprobs(ids, 3)
    r = oai.chat.completions.create(model="default", messages=msgs, max_tokens=8, logprobs=True, top_logprobs=3,
                                    **GREEDY)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([d[t] for d, t in zip(lps, toks)], abs=1e-5)
    for c, d in zip(content, lps):
        assert len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode())
        assert [t.logprob for t in c.top_logprobs] == pytest.approx(sorted(d.values(), reverse=True)[:3], abs=1e-5)
    plain = oai.chat.completions.create(model="default", messages=msgs, max_tokens=2, **GREEDY)
    assert plain.choices[0].logprobs is None


def test_echo_with_logprobs_is_a_loglikelihood(oai, direct):
    """echo + logprobs + max_tokens=1 (how evaluation harnesses ask for a loglikelihood): the prompt's
    text, tokens and prompt logprobs come first (None for the first token), equal to the engine's
    prompt_logprobs (checked against transformers in tests/engine/test_prompt_logprobs.py)."""
    tok = direct.tokenizer
    ids = tok.encode(PROMPTS[3], add_special_tokens=False)

    async def solo():
        llm = AsyncLLM(None, device="cpu", dtype="float32")
        async for out in llm.generate(PROMPTS[3], SamplingParams(max_tokens=1, prompt_logprobs=1, logprobs=1)):
            llm.shutdown()
            return out
    ref = asyncio.run(solo())
    r = oai.completions.create(model="default", prompt=PROMPTS[3], max_tokens=1, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text.startswith(tok.decode(ids, skip_special_tokens=True))
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [d[t] for d, t in zip(ref.prompt_logprobs[1:], ids[1:])] + [ref.outputs[0].logprobs[0][ref.outputs[0].token_ids[0]]]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    chunks = list(oai.completions.create(model="default", prompt=PROMPTS[3], max_tokens=3, echo=True, stream=True,
                                         temperature=0))
    assert "".join(ch.choices[0].text for ch in chunks).startswith(tok.decode(ids, skip_special_tokens=True))


def test_n_samples(oai, direct):
    """n > 1: one choice per sample (index i), each equal to AsyncLLM run alone with seed + i;
    streamed chunks name their choice; usage counts every sample's tokens."""
    async def solo():
        llm = AsyncLLM(None, device="cpu", dtype="float32")
        res = []
        for i in range(3):
            toks = []
            async for out in llm.generate(PROMPTS[1], SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i,
                                                                     ignore_eos=True)):
                toks += out.outputs[0].token_ids
            res.append(toks)
        llm.shutdown()
        return res
    ref = asyncio.run(solo())
    kw = dict(model="default", prompt=PROMPTS[1], max_tokens=6, n=3, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    r = oai.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2] and [c.token_ids for c in r.choices] == ref
    assert r.usage.completion_tokens == 18
    assert [c.text for c in r.choices] == [direct.tokenizer.decode(t, skip_special_tokens=True) for t in ref]
    chunks = list(oai.completions.create(stream=True, **kw))
    for i in range(3):
        assert sum((ch.choices[0].token_ids for ch in chunks if ch.choices[0].index == i), []) == ref[i]
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    greedy = direct.run([_chat_ids(direct, msgs)])[0][:5]
    r = oai.chat.completions.create(model="default", messages=msgs, max_tokens=5, n=2, **GREEDY)
    assert [c.token_ids for c in r.choices] == [greedy, greedy]


def test_chat_equals_async_llm(oai, direct):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": PROMPTS[3]}]
    ids = _chat_ids(direct, msgs)
    ref = direct.run([ids])[0][:MAX_TOKENS]
    r = oai.chat.completions.create(model="default", messages=msgs, max_tokens=MAX_TOKENS, **GREEDY)
    c = r.choices[0]
    assert c.prompt_token_ids == ids and c.token_ids == ref
    assert c.message.role == "assistant" and c.message.content == direct.tokenizer.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == MAX_TOKENS
    # streamed, with chat_template_kwargs reaching the template and text content parts joined
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPTS[3][:10]},
                                          {"type": "text", "text": PROMPTS[3][10:]}]}]
    ids2 = _chat_ids(direct, [{"role": "user", "content": PROMPTS[3]}], shout=True)
    ref2 = direct.run([ids2])[0][:MAX_TOKENS]
    chunks = list(oai.chat.completions.create(
        model="default", messages=parts, max_completion_tokens=MAX_TOKENS, stream=True, temperature=0,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True, "chat_template_kwargs": {"shout": True}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [ch for ch in chunks if ch.choices]
    assert body[0].choices[0].prompt_token_ids == ids2
    assert sum((ch.choices[0].token_ids for ch in body), []) == ref2
    text = "".join(ch.choices[0].delta.content or "" for ch in body)
    assert text == direct.tokenizer.decode(ref2, skip_special_tokens=True)
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(ids2) and chunks[-1].usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize("kind,kwargs,param", [
    ("cmpl", dict(temperature=-1.0), "temperature"),
    ("cmpl", dict(top_p=1.5), "top_p"),
    ("cmpl", dict(max_tokens=0), "max_tokens"),
    ("cmpl", dict(extra_body={"temperature": "hot"}), "temperature"),
    ("cmpl", dict(logprobs=21), "logprobs"),
    ("cmpl", dict(n=0), "n"),
    ("cmpl", dict(stop=["ok", ""]), "stop"),
    ("cmpl", dict(presence_penalty=2.5), "presence_penalty"),
    ("cmpl", dict(logit_bias={"x": 1}), "logit_bias"),
    ("cmpl", dict(logit_bias={"99999": 1}), "logit_bias"),              # outside the vocabulary
    ("chat", dict(frequency_penalty=-3), "frequency_penalty"),
    ("chat", dict(extra_body={"min_tokens": 99}), "min_tokens"),         # above max_tokens
    ("cmpl", dict(prompt=[5000]), "prompt"),                 # token id outside the vocabulary
    ("cmpl", dict(prompt=["a", "b"]), "prompt"),             # batches are not supported
    ("cmpl", dict(prompt="x " * 10000), "prompt"),           # longer than max_model_len
    ("chat", dict(top_logprobs=2), "top_logprobs"),                     # without logprobs=true
    ("chat", dict(logprobs=True, top_logprobs=25), "top_logprobs"),
    ("chat", dict(n=99), "n"),                                          # above --max-num-seqs
    ("chat", dict(stop=[""]), "stop"),
    ("chat", dict(messages=[]), "messages"),
    ("chat", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content.0.type"),
    ("chat", dict(extra_body={"chat_template_kwargs": {"tokenize": True}}), "chat_template_kwargs"),
])
def test_bad_requests_are_400_naming_the_field(oai, kind, kwargs, param):
    kw = {"model": "default", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "cmpl":
            kw.setdefault("prompt", "hello")
            oai.completions.create(**kw)
        else:
            kw.setdefault("messages", [{"role": "user", "content": "hello"}])
            oai.chat.completions.create(**kw)
    err = e.value
    assert err.status_code == 400 and err.param == param and err.type == "invalid_request_error"
    assert set(err.body) == {"message", "type", "param", "code"} and err.body["message"]


def test_bad_streaming_request_is_400_and_unknown_model_404(oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="default", prompt="hi", max_tokens=4, temperature=-2, stream=True)
    assert e.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="gpt-4", prompt="hi", max_tokens=4)
    assert e.value.param == "model" and e.value.code == "model_not_found"
