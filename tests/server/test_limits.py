"""Behaviour under load limits, on a real server with one running slot and a waiting queue of one:
a full queue answers 429 (and the server goes on), a client that disconnects while its request is
still queued or running aborts it, and nothing is leaked."""
import asyncio
import time

import openai
import pytest

from server_harness import check_clean_exit, client, start_module_server, wait_idle

LONG = {"model": "default", "prompt": "The river ran through", "max_tokens": 3000, "temperature": 0,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_module_server(tmp_path_factory, "--max-num-seqs", "1", "--max-waiting-requests", "1")
    yield srv
    check_clean_exit(srv)


async def _poll(c, url, cond, timeout=20.0):
    t0 = time.monotonic()
    while True:
        h = (await c.get(url + "/health")).json()
        if cond(h):
            return h
        assert time.monotonic() - t0 < timeout, f"timed out: {h}"
        await asyncio.sleep(0.02)


def test_queue_full_is_429_and_disconnects_abort(server):
    import httpx
    url = server.url

    async def main():
        async with httpx.AsyncClient(timeout=30) as c:
            async with c.stream("POST", url + "/v1/completions", json={**LONG, "stream": True}) as ra:
                assert ra.status_code == 200
                lines = ra.aiter_lines()          # keep the iterator: dropping it would close A's stream
                while not (await lines.__anext__()).startswith("data:"):
                    pass                                           # A runs (the only slot)
                queued = asyncio.create_task(c.post(url + "/v1/completions", json=LONG))   # B waits
                await _poll(c, url, lambda h: h["num_requests_waiting"] == 1 and h["num_requests_running"] == 1)
                # C: the queue is full
                r = await c.post(url + "/v1/completions", json={**LONG, "max_tokens": 2})
                assert r.status_code == 429 and r.headers.get("retry-after") == "1"
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
                oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    await oai.chat.completions.create(model="default", max_tokens=2,
                                                      messages=[{"role": "user", "content": "hi"}])
                await oai.close()
                # B's client gives up while B is queued: B leaves the queue at once
                queued.cancel()
                await _poll(c, url, lambda h: h["num_requests_waiting"] == 0)
                assert not queued.done() or queued.cancelled()
            # leaving the block closed A's connection: A is aborted
            await _poll(c, url, lambda h: h["num_requests_running"] == 0)
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(main(), 60))
    assert time.monotonic() - t0 < 30                               # A's 3000 tokens were not generated
    wait_idle(server)
    # the server goes on
    r = client(server).completions.create(model="default", prompt="hello", max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    import httpx as hx
    text = hx.get(url + "/metrics").text
    assert 'hybrid_engine_requests_rejected_total{model_name="default",status="429"} 2.0' in text
    assert 'hybrid_engine_requests_aborted_total{model_name="default"} 2.0' in text
