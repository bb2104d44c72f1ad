"""The OpenAI-compatible server under operation: Prometheus metrics, clients that disconnect, and
96 concurrent streaming clients with disconnects and invalid requests mixed in (the server and the
reference of ``openai_case.py``)."""
import asyncio
import json
import random
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openai_case import GREEDY, KEY, MAX_TOKENS, PROMPTS, _chat_ids, direct  # noqa: F401 (fixture)
from server_harness import wait_idle


def _metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "le"))
            if "le" not in s.labels:
                out[key] = s.value
    return out


def test_metrics(server, oai):
    before = _metrics(server)
    n = 3
    for p in PROMPTS[2:2 + n]:
        oai.completions.create(model="default", prompt=p, max_tokens=MAX_TOKENS, **GREEDY)
    wait_idle(server)
    m = _metrics(server)
    h = server.health()
    assert m["hybrid_engine_time_to_first_token_seconds_count"] - before.get(
        "hybrid_engine_time_to_first_token_seconds_count", 0) == n
    assert m["hybrid_engine_time_per_output_token_seconds_count"] - before.get(
        "hybrid_engine_time_per_output_token_seconds_count", 0) == n
    assert m["hybrid_engine_time_to_first_token_seconds_sum"] > 0
    assert m["hybrid_engine_generation_tokens_total"] - before.get("hybrid_engine_generation_tokens_total", 0) == \
        n * MAX_TOKENS
    assert m["hybrid_engine_request_success_total,finish_reason=length"] >= n
    assert m["hybrid_engine_kv_blocks_total"] == h["total_blocks"] == m["hybrid_engine_kv_blocks_free"]
    assert m["hybrid_engine_mamba_slots_total"] == 16 == m["hybrid_engine_mamba_slots_free"]
    assert m["hybrid_engine_num_requests_running"] == 0 and m["hybrid_engine_num_requests_waiting"] == 0
    # n-gram drafts on the repetitive prompts: proposed and (some) accepted
    assert m["hybrid_engine_spec_decode_num_draft_tokens_total"] == h["drafts_proposed"] > 0
    assert m["hybrid_engine_spec_decode_num_accepted_tokens_total"] == h["drafts_accepted"]
    assert m["hybrid_engine_spec_decode_acceptance_rate"] == pytest.approx(h["drafts_accepted"] / h["drafts_proposed"])


def test_disconnect_aborts(server):
    """A streaming client that closes early and a non-streaming one that times out: both requests
    are aborted in the engine at once (every slot and block free again, long before max_tokens)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "default", "prompt": PROMPTS[0], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    aborted0 = _metrics(server).get("hybrid_engine_requests_aborted_total", 0)
    t0 = time.monotonic()
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=auth) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            assert server.health()["num_requests_running"] == 1
    wait_idle(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=1.0)
    wait_idle(server)
    assert time.monotonic() - t0 < 20             # 3000 tokens were not generated
    assert _metrics(server)["hybrid_engine_requests_aborted_total"] - aborted0 == 2


def test_load(server, direct):
    """96 concurrent streaming clients (completions and chat), with disconnects and invalid requests
    mixed in: every valid request's tokens equal its solo run, the invalid ones get 400 naming the
    field, and afterwards nothing is leaked."""
    rng = random.Random(3)
    n = 96
    auth = {"Authorization": f"Bearer {KEY}"}
    jobs = []
    for i in range(n):
        p = PROMPTS[i % len(PROMPTS)]
        mode = "disconnect" if i % 8 == 3 else "invalid" if i % 8 == 5 else "ok"
        chat = i % 3 == 0
        jobs.append(dict(prompt=p, mode=mode, chat=chat, max_tokens=rng.randint(1, 16), delay=rng.uniform(0, 1.0)))
    refs = {}
    for j in jobs:
        ids = _chat_ids(direct, [{"role": "user", "content": j["prompt"]}]) if j["chat"] else j["prompt"]
        refs[id(j)] = direct.run([ids])[0][:j["max_tokens"]]

    async def one(c: httpx.AsyncClient, j):
        await asyncio.sleep(j["delay"])
        body = {"model": "default", "max_tokens": j["max_tokens"], "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        if j["chat"]:
            url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": j["prompt"]}]
        else:
            url, body["prompt"] = "/v1/completions", j["prompt"]
        if j["mode"] == "invalid":
            body["top_k"] = -7
        async with c.stream("POST", server.url + url, json=body, headers=auth) as r:
            if j["mode"] == "invalid":
                await r.aread()
                assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"
                return "invalid"
            assert r.status_code == 200
            toks, finish = [], None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])
                assert "error" not in ch, ch
                for choice in ch["choices"]:
                    toks += choice.get("token_ids", [])
                    finish = choice["finish_reason"] or finish
                if j["mode"] == "disconnect" and toks:
                    return "disconnected"              # leaving the block closes the connection
            assert toks == refs[id(j)], (j, toks)
            assert finish == "length"
            return "ok"

    async def main():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            return await asyncio.wait_for(asyncio.gather(*[one(c, j) for j in jobs]), 30)
    t0 = time.monotonic()
    res = asyncio.run(main())
    dt = time.monotonic() - t0
    assert res.count("ok") == sum(j["mode"] == "ok" for j in jobs)
    assert res.count("invalid") == n // 8 and res.count("disconnected") == n // 8
    wait_idle(server)
    assert dt < 30
