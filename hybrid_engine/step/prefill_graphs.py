"""CUDA graphs for steps of one prefill row (issue 19: a cached-prefix prefill is
host-bound: on the 8B shape its 300 new tokens cost ~11 ms of GPU work and ~27 ms of launches).

A step qualifies when it has one prefill row of ``T <= max_tokens`` tokens and no decode rows (a
request arriving at an idle engine, the TTFT a user waits for) or decode rows that fit a mixed
graph's count (``decode_buckets``: a new chat turn arriving while other conversations decode).
A mixed step is one forward of its decode rows and its prefill row, so the weights are read once:
on the 8B shape its two replays (``forward_split``: the prefill row here, the decode rows in the
executor's decode graph; still the fallback when no mixed graph may be captured) cost a decode
step's ~6 ms more, and a chat turn's TTFT with them (benchmarks/results/2026-11-27-mixed-prefill-
graphs-h100.md). Its forward replays a graph of ``bucket > T`` tokens keyed by ``PrefillKey`` (the
bucket; the decode rows padded to ``mixed_decode_buckets``, and their width; how many prefix-cache
restores, checkpoint saves and logits rows the step has: each changes the kernels launched).
The key, the padded static batch and the copy-in are ``prefill_layout``.

Graphs are captured lazily, the first time a key is seen (a sync and ~two forwards, once per
key, logged), at most ``max_graphs`` of them; other steps run eagerly, and so do keys whose
capture raised (logged; an out-of-memory capture stops all further captures). The capture's warm-up
forward runs on a harmless copy of the real step: its Mamba rows at ``NULL_SLOT``, its KV writes
in the null block, its restores into ``NULL_SLOT``; its checkpoint saves go to the step's own
rows (pinned for this step, rewritten by the replay that follows).
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from .capture import capturing
from .forward_batch import ForwardBatch
from .prefill_layout import PrefillKey, load_prefill, prefill_bucket, split_decode_prefill, static_prefill_batch
from .prefill_staging import PrefillStatic, in_arena

logger = logging.getLogger("hybrid_engine")

MAX_GRAPH_TOKENS = 2048     # longer prefills are GPU-bound: their launches hide behind the kernels
MAX_GRAPHS = 192            # the start-up warm-up captures ~64 (a mixed graph per bucket up to 512
                            # tokens beside 1 and 5 decoding requests), ~128 with adaptive speculation
PREFILL_ONLY_SLOTS = 32     # of those, kept for prefill-only keys (a request at an idle engine: its
                            # TTFT), which mixed keys may not take; a mixed step then splits


def forward_split(fb: ForwardBatch, prefill_forward, decode_forward) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A step of decode rows and one prefill row as two forwards: ``prefill_forward(prefill part)``
    (a prefill graph; None: it has none, and nothing ran) first, then ``decode_forward(decode
    part)`` (a decode graph). -> (hidden [T, D], logits [L, V]) in the step's token and logits
    order (decode rows first), or None (the caller runs the whole step eagerly).

    Why: such a step is what a chat workload runs most (conversations decoding while a new turn
    prefills), and eagerly it is bound by its launches (~27 ms of host work on the 8B shape,
    ``benchmarks/results/2026-11-26-ttft-host-profile-h100.md``). Two replays read the weights twice
    (more GPU time) but cost little host time."""
    dec, pre = split_decode_prefill(fb)
    got = prefill_forward(pre)
    if got is None:
        return None
    hidden_p, logits_p = got
    hidden_d, logits_d = decode_forward(dec)
    return torch.cat([hidden_d, hidden_p]), torch.cat([logits_d, logits_p])


@dataclass
class _PrefillGraph:
    graph: torch.cuda.CUDAGraph   # (anything with replay(): tests record an eager rerun)
    fb: ForwardBatch              # static inputs (load_prefill fills them, or one H2D copy: static)
    hidden: torch.Tensor          # [bucket, D] static output (a view of the graphs' one hidden buffer)
    logits: torch.Tensor          # [key.logits, V] static output
    static: PrefillStatic | None  # prefill-only keys: fb as views of one arena (MixedPlan stages into it)


class PrefillGraphs:
    """The prefill graphs of one model (owned by its ``CudaGraphExecutor``)."""

    def __init__(self, forward, *, max_blocks: int, max_model_len: int, device: torch.device,
                 max_tokens: int = MAX_GRAPH_TOKENS, max_graphs: int = MAX_GRAPHS, pad_restores: bool = False,
                 decode_buckets: tuple[int, ...] = (), max_decode_len: int = 1):
        """``forward(fb) -> (hidden [T, D], logits [L, V])``: the eager forward to capture.
        ``pad_restores``: the model has checkpoint storage, so every graph restores one row (see
        ``PrefillKey.of``). ``decode_buckets``: the decode-row counts of mixed graphs (a step of
        decode rows and one prefill row in one forward; ``mixed_decode_buckets``); empty: none.
        ``max_decode_len``: the widest decode row (1 + K)."""
        self._forward = forward
        self.pad_restores = pad_restores
        self.decode_buckets = tuple(sorted(decode_buckets))
        self.max_decode_tokens = (self.decode_buckets[-1] * max_decode_len) if self.decode_buckets else 0
        self.mixed_steps = 0              # steps of decode rows and a prefill row replayed as one graph
        self.staged_steps = 0             # prefill-only steps staged straight into their graph's arena
        self.max_blocks, self.max_model_len, self.device = max_blocks, max_model_len, device
        self.max_tokens, self.max_graphs = max_tokens, max_graphs
        self.graphs: dict[PrefillKey, _PrefillGraph] = {}
        self.pool = None                  # one memory pool for all of them (never replayed concurrently)
        self._full_logged = False
        self.capture_s = 0.0              # seconds spent capturing (requests wait meanwhile)
        self._failed: set[PrefillKey] = set()     # keys whose capture raised: eager from then on
        # [prefill_bucket(max_tokens), D]: every graph's hidden output (one buffer, not one per graph:
        # up to 192 of those would hold ~3 GB of an 8B model outside the KV budget)
        self._hidden_out: torch.Tensor | None = None
        self._logits_out: torch.Tensor | None = None    # [rows, V]: every graph's logits output, likewise

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(hidden [T, D], logits [L, V]) from a graph replay; None: the step does not qualify,
        no more graphs may be captured, or its key's capture failed (the caller runs it eagerly).
        The outputs are views of static buffers, valid until the next replay of *any* prefill
        graph (they share one memory pool, so a later graph's outputs may sit in an earlier one's
        scratch): the step consumes them in stream order, nothing keeps them past it."""
        key = PrefillKey.of(fb, self.max_tokens, pad_restores=self.pad_restores, decode_buckets=self.decode_buckets)
        if key is None:
            return None
        g = self.graphs.get(key)
        if g is None:
            if key in self._failed:
                return None
            if key.decode_rows and len(self.graphs) >= self.max_graphs - PREFILL_ONLY_SLOTS:
                return None                   # the last slots are kept for prefill-only keys: split
            if len(self.graphs) >= self.max_graphs:
                if not self._full_logged:
                    self._full_logged = True
                    logger.warning("prefill CUDA graphs: %d captured (the limit); prefills of new shapes run "
                                   "eagerly", self.max_graphs)
                return None
            try:
                g = self.graphs[key] = self._capture(key, fb)
            except torch.cuda.OutOfMemoryError as e:
                # the KV cache took the memory a capture needs: stop capturing, say so once
                self.max_graphs = len(self.graphs)
                logger.warning("prefill CUDA graphs: capturing %s ran out of memory (%s); prefills of new "
                               "shapes run eagerly (lower kv_cache_memory_fraction to keep them)", key, e)
                self._full_logged = True
                return None
            except Exception as e:            # e.g. an op a capture does not allow: this key runs eagerly
                self._failed.add(key)
                logger.warning("prefill CUDA graphs: capturing %s failed (%s: %s); steps of this shape run "
                               "eagerly", key, type(e).__name__, e)
                return None
        # only PrefillStatic.view aliases a static buffer, and it stages every field: no copies
        if fb.input_ids.data_ptr() == g.fb.input_ids.data_ptr():
            self.staged_steps += 1
        else:
            load_prefill(g.fb, fb)
        g.graph.replay()
        td, td_pad = fb.mamba.num_decode_tokens, key.decode_tokens
        self.mixed_steps += td > 0
        if td == td_pad:                   # no pad decode rows: the outputs are one slice
            return g.hidden[:fb.input_ids.shape[0]], g.logits
        # the real decode rows' tokens, then the prefill row's (past the pad decode rows)
        end = td_pad + fb.input_ids.shape[0] - td
        return (torch.cat([g.hidden[:td], g.hidden[td_pad:end]]),
                torch.cat([g.logits[:td], g.logits[td_pad:]]))

    def _capture(self, key: PrefillKey, fb: ForwardBatch) -> _PrefillGraph:
        t0 = time.perf_counter()
        with _sync_check_paused(self.device):     # capturing allocates and syncs, once per key
            static = static_prefill_batch(key, max_blocks=self.max_blocks, max_model_len=self.max_model_len,
                                          device=self.device)
            arena = None if key.decode_rows else in_arena(key, static)
            static = static if arena is None else arena.fb
            fresh = lambda: replace(static, mamba=replace(static.mamba))   # noqa: E731  (an empty chunk-layout memo)
            load_prefill(static, fb, harmless=True)
            graph, hidden, logits = self._record(fresh)
        took = time.perf_counter() - t0
        self.capture_s += took
        logger.info("captured a prefill CUDA graph %s in %.2fs (%d now)", key, took, len(self.graphs) + 1)
        return _PrefillGraph(graph=graph, fb=static, hidden=hidden, logits=logits, static=arena)

    def dest(self, num_tokens: int, *, restores: int, saves: int, logits: int) -> PrefillStatic | None:
        """The static inputs a prefill-only step of these host counts may be staged into
        (``prefill_staging``): those of its key's captured graph, else None (no graph yet: the
        step's forward captures one from a staged batch, or runs eagerly)."""
        key = PrefillKey.prefill_only(num_tokens, restores=restores, saves=saves, logits=logits,
                                      max_tokens=self.max_tokens, pad_restores=self.pad_restores)
        g = self.graphs.get(key) if key is not None else None
        return g.static if g is not None else None

    def _record(self, fresh):
        """-> (graph, hidden, logits) of ``self._forward(fresh())``, after one warm-up run of it on
        the harmless inputs ``fresh()`` holds (Triton compiles there). ``graph.replay()`` reruns the
        forward on whatever the static inputs hold then."""
        warm_hidden, warm_logits = self._forward(fresh())
        # one hidden and one logits buffer for every graph (outside the pool: a mixed graph's
        # decode rows' logits are ~0.5 MB a token on the 8B shape's vocabulary, and ~100 graphs
        # would keep theirs); a graph with more rows than the buffer has gets a larger one (earlier
        # graphs keep theirs)
        most = self.max_decode_tokens
        self._hidden_out = _at_least(self._hidden_out, warm_hidden, warm_hidden.shape[0],
                                     prefill_bucket(self.max_tokens) + most)
        self._logits_out = _at_least(self._logits_out, warm_logits, warm_logits.shape[0], most + 1)
        hidden_out = self._hidden_out[:warm_hidden.shape[0]]
        logits_out = self._logits_out[:warm_logits.shape[0]]
        del warm_hidden, warm_logits
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden, logits = self._forward(fresh())
            hidden_out.copy_(hidden)     # the model's own output buffers return to the pool
            logits_out.copy_(logits)
        if self.pool is None:
            self.pool = graph.pool()
        return graph, hidden_out, logits_out


def _at_least(buf: torch.Tensor | None, like: torch.Tensor, rows: int, most: int) -> torch.Tensor:
    """``buf`` if it has at least ``rows`` rows, else a new buffer shaped and typed as ``like``'s
    rows: of ``rows`` rows the first time (prefill-only graphs need few), of ``max(rows, most)``
    after (the most any graph needs: one growth at most, as earlier graphs keep the buffer they
    captured)."""
    if buf is not None and buf.shape[0] >= rows:
        return buf
    n = rows if buf is None else max(rows, most)
    return torch.empty((n, *like.shape[1:]), dtype=like.dtype, device=like.device)


@contextmanager
def _sync_check_paused(device: torch.device):
    """torch.cuda's sync debug mode off inside (a capture is a deliberate, once-per-key sync; the
    steps around it keep their checks)."""
    if device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
