"""benchmarks/profiling.py's GPU idle-gap analysis (``prefill_gaps``), on synthetic intervals and
events: the CUDA profile it reads needs a GPU, its arithmetic does not."""
from types import SimpleNamespace

from benchmarks.profiling import gap_rows, idle_gaps


def test_idle_gaps_are_the_uncovered_stretches_of_the_span():
    busy = [(30, 50), (10, 20), (45, 60), (100, 130), (200, 400)]       # unsorted, overlapping, past the end
    assert idle_gaps(busy, 0, 300, min_us=0) == [(0, 10), (20, 30), (60, 100), (130, 200)]
    assert idle_gaps(busy, 0, 300, min_us=15) == [(60, 100), (130, 200)]
    assert idle_gaps([], 5, 25, min_us=10) == [(5, 25)]
    assert idle_gaps([(0, 10)], 5, 40, min_us=1) == [(10, 40)]          # an interval starting before the span
    assert idle_gaps([(0, 50)], 5, 40, min_us=0) == []


def _ev(name, start, end):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_gap_rows_name_the_host_work_of_the_longest_gaps():
    host = [_ev("cudaGraphLaunch", 0, 5), _ev("aten::copy_", 12, 40), _ev("cudaStreamSynchronize", 35, 95),
            _ev("aten::empty", 100, 101)]
    ours = [_ev("hybrid_engine/llm.py(87): generate", 0, 200),              # encloses everything: too long
            _ev("hybrid_engine/step/transfer.py(80): stage", 11, 41),
            _ev("hybrid_engine/step/runner.py(50): wait", 34, 96)]
    rows = gap_rows(host, ours, [(10, 30), (50, 90), (99, 102)], top=2)
    assert [r["us"] for r in rows] == [40, 20]                           # longest first, top 2
    assert rows[0]["start_us"] == 50
    assert rows[0]["host"] == ["cudaStreamSynchronize (40 us)"]
    assert rows[0]["ours"] == ["hybrid_engine/step/runner.py(50): wait (40 us)"]
    assert rows[1]["host"] == ["aten::copy_ (18 us)"]
    assert rows[1]["ours"] == ["hybrid_engine/step/transfer.py(80): stage (19 us)"]
