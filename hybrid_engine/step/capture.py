"""Every CUDA graph capture of the engine goes through ``capturing``: ``torch.cuda.graph`` with
Python's cyclic garbage collector paused.

Why: an automatic collection that runs while a graph is being captured may free the CUDA graphs
of an engine that is gone (held only in reference cycles), and destroying a graph is an operation
not permitted while a stream captures. The capture is then invalidated ("operation failed due to a
previous error during capture"), and the default CUDA generator is left mid-capture, so the next
random draw fails too. The default GPU test tier hit it once on the H200 (2026-11-29): an engine
built in a process where earlier tests had left engines in cycles. torch no longer collects
before a capture (``force_cudagraph_gc`` is off by default, since a full collection per capture is
slow), so the collector is paused instead: cyclic garbage waits until the capture ends.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager

import torch


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, *, pool=None, **kw):
    """``with torch.cuda.graph(graph, pool=pool, **kw)`` with automatic garbage collection paused."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, **kw):
            yield
    finally:
        if enabled:
            gc.enable()
