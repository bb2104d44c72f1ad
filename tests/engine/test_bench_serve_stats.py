"""benchmarks/serve.py's statistics (what the serving results files report): TTFT at the first
chunk, inter-token gaps spread over a chunk's tokens, TPOT from the first to the last token (not to
the end of the stream), and ``--passes`` drawing the same workloads each pass and keeping the last."""
import argparse

import numpy as np
import pytest

from benchmarks import serve
from benchmarks.serve_report import summarize


def test_chunk_timing_and_tpot_stop_at_the_last_token(monkeypatch):
    clock = iter([1.0, 1.5, 2.5, 3.0])                 # three chunks, then the stream's end
    monkeypatch.setattr(serve.time, "perf_counter", lambda: next(clock))
    r = serve.Result(ok=False, prompt_len=4)
    for n in (2, 1, 3):
        r.arrived(n, t0=0.5)
    r.done(0.5)
    assert r.ok and r.output_len == 6 and r.ttft == pytest.approx(0.5) and r.latency == pytest.approx(2.5)
    assert r.itl == pytest.approx([0.5] + [1 / 3] * 3)  # the first chunk's 2 tokens add no gap
    s = summarize([r, serve.Result(ok=False, prompt_len=3, error="HTTP 500")], duration=2.0)
    assert s["completed"] == 1 and s["failed"] == 1 and s["first_error"] == "HTTP 500"
    # (last token 2.5 - sent 0.5 - TTFT 0.5) / 5 gaps: the tail to 3.0 is not a token
    assert s["mean_tpot_ms"] == pytest.approx(300.0)
    assert s["mean_ttft_ms"] == pytest.approx(500.0) and s["output_throughput"] == pytest.approx(3.0)


def test_passes_repeat_the_same_workloads_and_keep_the_last():
    args = argparse.Namespace(passes=2, seed=7, rates=[4.0, float("inf")])
    got = [(rate, kept, rng.integers(0, 1 << 30, 3).tolist()) for rate, rng, kept in serve.passes(args)]
    assert [(g[0], g[1]) for g in got] == [(4.0, False), (float("inf"), False), (4.0, True), (float("inf"), True)]
    assert got[0][2] == got[2][2] and got[1][2] == got[3][2]          # pass 2 draws what pass 1 drew
    assert got[0][2] != got[1][2]
    first = np.random.default_rng(7).integers(0, 1 << 30, 3).tolist()
    assert got[0][2] == first
