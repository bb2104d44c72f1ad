"""Graceful shutdown of a real server: on SIGTERM a short in-flight request finishes, a long stream
is aborted after the grace period (it ends with finish_reason "abort" and [DONE]), and the process
exits with status 0 without a traceback."""
import json
import threading
import time

import httpx
import pytest

from server_harness import ServerProcess

GRACE_S = 5
LONG_TOKENS = 3000          # far more than GRACE_S allows on CPU
SHORT_TOKENS = 60          # well within GRACE_S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("--shutdown-timeout", str(GRACE_S), log_path=tmp_path_factory.mktemp("server") / "log")
    yield srv
    srv.stop()


def test_sigterm_drains_then_aborts(server):
    url = server.url + "/v1/completions"
    long_stream = {"model": "default", "prompt": "The river", "max_tokens": LONG_TOKENS, "temperature": 0,
                   "ignore_eos": True, "stream": True}
    got = {}

    def stream_long():
        chunks = []
        with httpx.Client(timeout=60) as c, c.stream("POST", url, json=long_stream) as r:
            got["long_status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    got["long_started"] = True
        got["long"] = chunks

    def short_request():
        got["short_started"] = True
        r = httpx.post(url, json={"model": "default", "prompt": "hello", "max_tokens": SHORT_TOKENS,
                                  "temperature": 0, "ignore_eos": True}, timeout=60)
        got["short"] = r

    t_long = threading.Thread(target=stream_long)
    t_long.start()
    deadline = time.monotonic() + 30
    while not got.get("long_started"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t_short = threading.Thread(target=short_request)
    t_short.start()
    while True:                              # SIGTERM once the short request is in the engine
        h = server.health()
        if h["num_requests_running"] + h["num_requests_waiting"] >= 2:
            break
        assert time.monotonic() < deadline and "short" not in got
        time.sleep(0.005)
    t0 = time.monotonic()
    rc = server.terminate()
    t_long.join(30)
    t_short.join(30)
    assert rc == 0, server.log()
    assert "Traceback" not in server.log(), server.log()
    assert time.monotonic() - t0 < GRACE_S + 15
    r = got["short"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    chunks = got["long"]
    assert got["long_status"] == 200 and chunks[-1] == "[DONE]"
    last = json.loads(chunks[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    n = sum(1 for ch in chunks[:-1] if json.loads(ch)["choices"][0]["text"] is not None)
    assert 1 <= n < LONG_TOKENS              # aborted long before its max_tokens
