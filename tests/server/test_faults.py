"""A failed engine step fails only its own request: the app (in process, over httpx's ASGI
transport, with the runner patched to raise for one prompt) answers 500 with an OpenAI-shaped
error before streaming starts, an error event once it has started, and serves the next requests."""
import asyncio
import json

import httpx
import pytest
import torch

from hybrid_engine import AsyncLLM
from hybrid_engine.server import create_app
from hybrid_engine.server.serving import ServerConfig

FAIL_FIRST = [7, 7, 7, 7, 7]          # its first step raises
FAIL_LATER = [9, 9, 9, 9, 9]          # steps raise once it has 2 output tokens
GOOD = [11, 12, 13, 14]


@pytest.fixture(scope="module")
def app_llm():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = AsyncLLM(None, device="cpu", dtype="float32")
    runner, sched = llm.engine.runner, llm.engine.scheduler
    orig = runner.execute

    def execute(so):
        for row in so.rows:
            req = sched.requests.get(row.req_id)
            if req is None:
                continue
            if req.prompt_token_ids == FAIL_FIRST or (req.prompt_token_ids == FAIL_LATER
                                                      and len(req.output_token_ids) >= 2):
                raise RuntimeError("injected step failure")
        return orig(so)
    runner.execute = execute
    yield create_app(llm, ServerConfig(model_name="default")), llm
    llm.shutdown()
    torch.set_num_threads(threads)


def test_failed_step_is_500_and_server_goes_on(app_llm):
    app, llm = app_llm
    body = {"model": "default", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            out = {}
            for name, prompt, stream in [("first", FAIL_FIRST, False), ("first_stream", FAIL_FIRST, True),
                                         ("later", FAIL_LATER, False), ("later_stream", FAIL_LATER, True),
                                         ("good", GOOD, False), ("good_stream", GOOD, True)]:
                out[name] = await c.post("/v1/completions", json={**body, "prompt": prompt, "stream": stream})
            out["metrics"] = (await c.get("/metrics")).text
            out["health"] = (await c.get("/health")).json()
            return out
    out = asyncio.run(asyncio.wait_for(main(), 60))
    for name in ("first", "first_stream", "later"):
        r = out[name]
        err = r.json()["error"]
        assert r.status_code == 500, name
        assert err["type"] == "server_error" and err["code"] == "engine_step_failed"
        assert "injected step failure" in err["message"]
    # the stream had started: tokens, then an error event, then [DONE]
    r = out["later_stream"]
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_step_failed"
    streamed = sum((json.loads(e)["choices"][0]["token_ids"] for e in events[:-2]), [])
    assert len(streamed) == 2                # its first two tokens came before the failing step
    # the requests after them are served
    good = out["good"].json()
    assert out["good"].status_code == 200 and good["usage"]["completion_tokens"] == 6
    assert good["choices"][0]["finish_reason"] == "length"
    stream_events = [line[6:] for line in out["good_stream"].text.splitlines() if line.startswith("data: ")]
    assert json.loads(stream_events[-2])["choices"][0]["finish_reason"] == "length"
    assert 'hybrid_engine_requests_failed_total{model_name="default"} 4.0' in out["metrics"]
    h = out["health"]
    assert h["free_slots"] == h["total_slots"] and h["free_blocks"] == h["total_blocks"]
