"""``step/capture.capturing`` pauses the cyclic garbage collector for the capture only (its CUDA
behaviour: tests/gpu/test_capture_gc_cuda.py)."""
import contextlib
import gc

import pytest
import torch

from hybrid_engine.step import capture


def test_collector_paused_inside_and_restored_after(monkeypatch):
    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, **kw):
        seen.append((graph, pool, kw, gc.isenabled()))
        yield
    monkeypatch.setattr(torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with capture.capturing("g", pool="p", capture_error_mode="thread_local"):
        assert not gc.isenabled()
    assert gc.isenabled()
    assert seen == [("g", "p", {"capture_error_mode": "thread_local"}, False)]
    with pytest.raises(RuntimeError, match="boom"):             # restored when the capture raises
        with capture.capturing("g"):
            raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()                                               # a caller that had it off keeps it off
    try:
        with capture.capturing("g"):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
