"""Forward executors: eager, or CUDA graphs for uniform decode/verify batches.

``CudaGraphExecutor`` captures ``hidden = model(fb); logits = lm_head(hidden)`` for decode-only
batches of ``B`` rows x ``tokens_per_row`` tokens, for each B in a bucket list (largest first, one
memory pool) and each row width in ``widths`` (a *width* here is tokens per row, ``1 + K``; with
adaptive speculation also the narrower widths a step may verify, ``1`` included: a step that
verifies no drafts replays the plain decode graph).
Everything the graph reads is a persistent buffer owned here; a real batch is copied in and padded:
pad rows point at the null Mamba slot and the null KV block, with accepted count 1 and a seq_len that
only covers the null block. Steps of one prefill row replay the graphs of
``prefill_graphs.PrefillGraphs`` (``prefill_cuda_graphs``): alone, or beside decode rows in one
mixed graph; where no mixed graph may be captured, the prefill row replays a prefill graph and
the decode rows a decode graph (``prefill_graphs.forward_split``). Other batches with a prefill
row run eagerly.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from hybrid_engine.mamba_cache import NULL_SLOT

from .capture import capturing
from .decode_prep import DecodeDest
from .forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
from .prefill_graphs import PrefillGraphs, forward_split
from .prefill_layout import mixed_decode_buckets

logger = logging.getLogger("hybrid_engine")


class EagerExecutor:
    widths = None                 # any decode row width (no graphs)
    prefill = None                # no prefill graphs (CudaGraphExecutor's PrefillGraphs)

    def __init__(self, model, caches):
        self.model, self.caches = model, caches

    def forward(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [T, D], logits [L, V] float32 at fb.logits_indices)."""
        hidden = self.model(fb, self.caches)
        return hidden, self.model.compute_logits(hidden[fb.logits_indices])

    def follow(self, fb: ForwardBatch) -> None:
        """The forward's cache writes alone (``model.follow``): a drafter's model following a step
        after which it drafts nothing."""
        self.model.follow(fb, self.caches)

    def decode_dest(self, num_rows: int, tokens_per_row: int) -> tuple[DecodeDest, ForwardBatch] | None:
        """Persistent buffers a decode-only batch of ``num_rows`` rows of ``tokens_per_row`` tokens
        may be prepared in, and the ForwardBatch viewing its real rows; None: the caller allocates
        its own (eager)."""
        return None

    def prefill_dest(self, num_tokens: int, *, restores: int, saves: int, logits: int):
        """The static inputs (``prefill_staging.PrefillStatic``) a prefill-only step may be staged
        into; None: the caller stages its own batch."""
        return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    fb: ForwardBatch              # static input buffers, sized for this bucket
    hidden: torch.Tensor          # [B * tokens_per_row, D] static output
    logits: torch.Tensor          # [B * tokens_per_row, V] static output


class CudaGraphExecutor(EagerExecutor):
    def __init__(self, model, caches, *, num_spec: int, max_blocks: int, max_model_len: int,
                 block_size: int, buckets: tuple[int, ...], device: torch.device,
                 widths: tuple[int, ...] | None = None, prefill_graphs: bool = False,
                 pad_restores: bool | None = None):
        """``widths``: the row widths (tokens per decode row) to capture; default ``(1 + num_spec,)``.
        ``prefill_graphs``: also replay steps of one prefill row, alone or beside decode rows
        (captured lazily). ``pad_restores``: the model has checkpoint storage, so prefill graphs
        pad restores to one (``PrefillGraphs``); None: whether ``caches`` has checkpoint rows now
        (a draft model's are attached after its executors are built, so it says)."""
        super().__init__(model, caches)
        self.max_tokens_per_row = 1 + num_spec                     # the widest row
        self.widths = tuple(sorted(set(widths or (self.max_tokens_per_row,))))   # tokens per row
        if self.widths[-1] > self.max_tokens_per_row or self.widths[0] < 1:
            raise ValueError(f"widths must lie in 1..{self.max_tokens_per_row}, got {widths}")
        self.block_size, self.max_blocks, self.max_model_len = block_size, max_blocks, max_model_len
        self.device = device
        self.buckets = tuple(sorted(set(buckets)))
        # [tokens per row][bucket] -> graph
        self.graphs_by_width: dict[int, dict[int, _Graph]] = {w: {} for w in self.widths}
        self.graphs = self.graphs_by_width.get(self.max_tokens_per_row, {})   # [bucket] of the widest rows
        # (rows, tokens per row) -> prepare-in-place buffers, views
        self._views: dict[tuple[int, int], tuple[DecodeDest, ForwardBatch]] = {}
        # (rows, tokens per row) -> graph, outputs
        self._outs: dict[tuple[int, int], tuple[_Graph, torch.Tensor, torch.Tensor]] = {}
        self.pool = None                  # the graphs' memory pool (greedy_graphs captures into it too)
        self._capture_all()
        ckpts = caches.checkpoints
        self.split_steps = 0              # steps run as a decode graph plus a prefill graph
        self.prefill = (PrefillGraphs(lambda fb: EagerExecutor.forward(self, fb), max_blocks=max_blocks,
                                      max_model_len=max_model_len, device=device,
                                      pad_restores=(ckpts is not None and ckpts.num_rows > 0
                                                    if pad_restores is None else pad_restores),
                                      decode_buckets=mixed_decode_buckets(self.buckets),
                                      max_decode_len=self.max_tokens_per_row)
                        if prefill_graphs else None)
        if self.prefill is not None:
            logger.info("prefill CUDA graphs: one prefill row of up to %d tokens, alone or beside %s decode rows "
                        "(one mixed graph), captured on first use", self.prefill.max_tokens,
                        "/".join(map(str, self.prefill.decode_buckets)))

    def _static_batch(self, bucket: int, tokens_per_row: int) -> ForwardBatch:
        dev = self.device
        num_tokens = bucket * tokens_per_row
        z64 = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
        attn = AttnMetadata(
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=dev) * tokens_per_row,
            seq_lens=torch.full((bucket,), tokens_per_row, dtype=torch.int32, device=dev),
            block_tables=torch.zeros(bucket, self.max_blocks, dtype=torch.int32, device=dev),
            slot_mapping=z64(num_tokens), max_query_len=tokens_per_row,
            max_seq_len=self.max_model_len + 2 * tokens_per_row)
        mamba = MambaMetadata(bucket, tokens_per_row, torch.full((bucket,), NULL_SLOT, dtype=torch.int64, device=dev),
                              torch.ones(bucket, dtype=torch.int64, device=dev), z64(1), (0,), z64(0),
                              torch.zeros(0, dtype=torch.bool, device=dev))
        return ForwardBatch(z64(num_tokens), z64(num_tokens), attn, mamba, torch.arange(num_tokens, device=dev))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        # largest first (tokens per graph): one pool fits all
        for tokens_per_row, bucket in sorted(((w, b) for w in self.widths for b in self.buckets),
                                             key=lambda wb: -wb[0] * wb[1]):
            fb = self._static_batch(bucket, tokens_per_row)
            for _ in range(2):                                      # warm-up (Triton compiles here)
                EagerExecutor.forward(self, fb)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with capturing(g, pool=pool):
                hidden, logits = EagerExecutor.forward(self, fb)
            pool = g.pool()
            self.graphs_by_width[tokens_per_row][bucket] = _Graph(g, fb, hidden, logits)
        self.pool = pool
        torch.cuda.synchronize(self.device)
        used = free0 - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d CUDA graphs (B in %s, tokens per row in %s) in %.1fs, %.1f MiB",
                    len(self.buckets) * len(self.widths), list(self.buckets), list(self.widths),
                    time.perf_counter() - t0, used / 2**20)

    def _decode_graph_fits(self, md: MambaMetadata) -> bool:
        """A decode-only batch of a captured width and at most the largest bucket's rows."""
        return not (md.num_prefill_rows or md.num_decode_rows == 0 or md.decode_len not in self.graphs_by_width
                    or md.num_decode_rows > self.buckets[-1])

    def follow(self, fb: ForwardBatch) -> None:
        """A decode-only step a graph fits: its replay (host-cheaper than the eager follow's
        launches, the same cache writes); otherwise ``model.follow``."""
        if self._decode_graph_fits(fb.mamba):
            self.forward(fb)
        else:
            super().follow(fb)

    def forward(self, fb: ForwardBatch):
        md = fb.mamba
        num_rows, tokens_per_row = md.num_decode_rows, md.decode_len
        if md.num_prefill_rows and self.prefill is not None:
            got = self.prefill.forward(fb)            # None: no graph of this step's key (mixed or not)
            if got is None and self._splits(fb):      # decode rows + one prefill row: two replays
                got = forward_split(fb, self.prefill.forward, self.forward)
                self.split_steps += got is not None
            if got is not None:
                return got
        if not self._decode_graph_fits(md):
            return super().forward(fb)
        key = (num_rows, tokens_per_row)
        got = self._outs.get(key)
        if got is None:                     # the bucket and its output views, once per row count
            g = self.graphs_by_width[tokens_per_row][next(x for x in self.buckets if x >= num_rows)]
            num_tokens = num_rows * tokens_per_row
            got = self._outs[key] = (g, g.hidden[:num_tokens], g.logits[:num_tokens])
        g, hidden, logits = got
        if fb.input_ids.data_ptr() != g.fb.input_ids.data_ptr():     # else prepared in place
            self._load(g.fb, fb, num_rows, tokens_per_row)
        g.graph.replay()
        return hidden, logits

    def prefill_dest(self, num_tokens: int, *, restores: int, saves: int, logits: int):
        return None if self.prefill is None else self.prefill.dest(num_tokens, restores=restores, saves=saves,
                                                                   logits=logits)

    def _splits(self, fb: ForwardBatch) -> bool:
        """Whether a step runs as a decode graph plus a prefill graph: decode rows of a captured
        width and count, and exactly one prefill row short enough for the prefill graphs (host
        shapes only: a long chunk goes eager without building the split views)."""
        md = fb.mamba
        return (md.num_prefill_rows == 1 and 0 < md.num_decode_rows <= self.buckets[-1]
                and md.decode_len in self.graphs_by_width
                and fb.input_ids.shape[0] - md.num_decode_tokens <= self.prefill.max_tokens)

    def decode_dest(self, num_rows: int, tokens_per_row: int) -> tuple[DecodeDest, ForwardBatch] | None:
        """The static buffers of the smallest bucket >= num_rows (``prepare_decode`` fills its pad
        rows too), and a ForwardBatch of views on the first num_rows rows, which ``forward`` replays
        without copies. Views are built once per row count."""
        if not 0 < num_rows <= self.buckets[-1] or tokens_per_row not in self.graphs_by_width:
            return None
        got = self._views.get((num_rows, tokens_per_row))
        if got is None:
            bucket = next(x for x in self.buckets if x >= num_rows)
            f = self.graphs_by_width[tokens_per_row][bucket].fb
            a, m = f.attn, f.mamba
            dest = DecodeDest(f.input_ids, f.positions, a.slot_mapping, a.seq_lens, a.block_tables,
                              m.decode_slots, m.num_accepted)
            num_tokens = num_rows * tokens_per_row
            view = ForwardBatch(
                f.input_ids[:num_tokens], f.positions[:num_tokens],
                AttnMetadata(a.query_start_loc[:num_rows + 1], a.seq_lens[:num_rows], a.block_tables[:num_rows],
                             a.slot_mapping[:num_tokens], a.max_query_len, a.max_seq_len),
                MambaMetadata(num_rows, tokens_per_row, m.decode_slots[:num_rows], m.num_accepted[:num_rows],
                              m.prefill_query_start_loc, m.prefill_qsl_cpu, m.prefill_slots, m.has_initial_state),
                f.logits_indices[:num_tokens])
            got = self._views[(num_rows, tokens_per_row)] = (dest, view)
        return got

    def _load(self, dst: ForwardBatch, src: ForwardBatch, num_rows: int, tokens_per_row: int) -> None:
        """Copy a real decode batch into the static buffers; rows >= num_rows become padding."""
        n, num_tokens = num_rows, num_rows * tokens_per_row
        dst.input_ids[:num_tokens].copy_(src.input_ids)
        dst.input_ids[num_tokens:].zero_()
        dst.positions[:num_tokens].copy_(src.positions)
        da, sa = dst.attn, src.attn
        da.seq_lens[:n].copy_(sa.seq_lens)
        da.seq_lens[n:].fill_(tokens_per_row)
        num_blocks = sa.block_tables.shape[1]
        da.block_tables[:n, :num_blocks].copy_(sa.block_tables)
        da.block_tables[:n, num_blocks:].zero_()
        da.block_tables[n:].zero_()
        da.slot_mapping[:num_tokens].copy_(sa.slot_mapping)
        da.slot_mapping[num_tokens:].zero_()                         # pad tokens write the null block
        dm, sm = dst.mamba, src.mamba
        dm.decode_slots[:n].copy_(sm.decode_slots)
        dm.decode_slots[n:].fill_(NULL_SLOT)
        dm.num_accepted[:n].copy_(sm.num_accepted)
        dm.num_accepted[n:].fill_(1)


def capture_step_graph(body, *, device: torch.device, pool) -> torch.cuda.CUDAGraph:
    """A fused step plan's graph of ``body()`` on ``pool`` (the executor's: the plans' graphs and
    the forward graphs they contain share it): one eager run first (Triton compiles there), a
    sync, then the capture."""
    body()
    torch.cuda.synchronize(device)
    g = torch.cuda.CUDAGraph()
    with capturing(g, pool=pool):
        body()
    return g


def capture_step_graphs(keys, body, *, device: torch.device, pool, staged: torch.Tensor):
    """A fused step plan's graphs: ``{key: graph of body(*key)}`` in ``keys`` order (largest first:
    one pool fits all), with the plan's staged header at N = 0 so every row is a pad row while
    capturing -> (graphs, seconds taken, device bytes they took)."""
    t0 = time.perf_counter()
    free0 = torch.cuda.mem_get_info(device)[0]
    staged[:2] = torch.tensor([0, 1])
    graphs = {key: capture_step_graph(lambda: body(*key), device=device, pool=pool) for key in keys}
    torch.cuda.synchronize(device)
    return graphs, time.perf_counter() - t0, free0 - torch.cuda.mem_get_info(device)[0]


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return tuple(x for x in sizes if x < max_num_seqs) + (max_num_seqs,)


def make_executor(model, caches, cfg, *, num_spec: int, max_blocks: int, max_model_len: int, block_size: int,
                  name: str = "target", widths: tuple[int, ...] | None = None, prefill_graphs: bool = False,
                  pad_restores: bool | None = None):
    """CUDA graphs for decode batches of ``[B, tokens_per_row]`` on CUDA (tokens_per_row in
    ``widths``, default ``1 + num_spec``), and with ``prefill_graphs`` for steps of one prefill
    row, alone or beside decode rows; eager otherwise. ``pad_restores``: see ``CudaGraphExecutor``."""
    if cfg.device.type != "cuda" or cfg.enforce_eager:
        logger.info("%s forward executor: eager (%s)", name, "enforce_eager" if cfg.enforce_eager else cfg.device.type)
        return EagerExecutor(model, caches)
    return CudaGraphExecutor(model, caches, num_spec=num_spec, max_blocks=max_blocks, max_model_len=max_model_len,
                             block_size=block_size, buckets=default_buckets(cfg.scheduler.max_num_seqs),
                             device=cfg.device, widths=widths, prefill_graphs=prefill_graphs,
                             pad_restores=pad_restores)
