"""A greedy decode step as one CUDA graph replay: input preparation, forward and argmax.

The steady state of greedy serving without speculation is a run of decode-only steps whose rows
all take the argmax. Run as separate host calls (``prepare_decode``, the forward graph, the
argmax), such a step costs more host time than its GPU time on a small model, and the GPU waits
(results/2026-11-22-async-gap-h100.md). ``GreedyStepGraphs`` captures the three as one graph per
bucket B and parity q:

    prepare_decode(header mode: N and W read from the staged array; previous outputs from the
    parity 1-q buffers) -> the bucket's forward -> argmax into tokens[q]; next starts into
    next_start[q]

so the host's calls for such a step are one H2D copy of the staged array (into a buffer whose
address the graphs hold), one replay, and the D2H of payload[q][:N].

In a spec engine whose drafter follows a step from its tokens alone (the n-gram drafter: a
``follower``, ``ngram_graphs.NgramFollower``) these graphs serve the steps that verify no drafts
after one that verified none (adaptive speculation at rest), and the follower's kernel is captured
after the argmax: it appends the tokens to the rows' histories and drafts K for the next step into
drafts[q]. Launched eagerly after the replay, that proposal took about a third of the runner's
fused-step finish (cProfile, H200, results/2026-11-29-spec-rest-follow-h200.md).

Parities: step N+1 reads the tokens and next starts of step N while writing its own, so the two
live in different buffers, and a step writes the buffers of the step before the previous one.
Every reader of those is ordered before that: the previous graph step's kernels run on the same
stream, and the side-stream D2H of a parity's tokens is waited for on the device (the main
stream waits on that copy's event before the buffers are written again; the step loop, which
reads a step's output before it launches the step after next, makes that wait free, but the
order does not depend on the loop). When the previous step did not come from these graphs (a
mixed or a sampled step), its outputs are first copied into the buffers the graph reads (two
copies, on those steps only).
"""
from __future__ import annotations

import logging

import torch

from .decode_prep import DecodeDest, PrevOutputs
from .graphs import CudaGraphExecutor, EagerExecutor, capture_step_graphs
from .input_batch import InputBatch
from .spec_graphs import FusedSpecStep
from .step_io import StepRows
from .transfer import H2D, CurrentStream
from .triton_greedy_verify import chunk_buffers, greedy_verify

logger = logging.getLogger("hybrid_engine")


class GreedyStepGraphs:
    def __init__(self, executor: CudaGraphExecutor, *, block_size: int, max_blocks: int, follower=None):
        """``follower``: a spec engine's drafter step captured after the argmax (module docstring),
        with ``num_spec``, ``propose(slots, sampled, num_valid, next_start) -> drafts [B, K]`` and
        ``before_replay()`` (host); None without speculation."""
        if 1 not in executor.graphs_by_width:
            raise ValueError("greedy step graphs serve decode rows of one token: the executor has no width-1 graphs")
        self.ex, self.block_size, self.follower = executor, block_size, follower
        self.fwd = executor.graphs_by_width[1]         # [bucket] the one-token forward graphs
        self.batch: InputBatch | None = None           # the runner's, given by bind()
        self._rows = self._prev_idx = None             # [N] batch rows / previous-step rows from applies()
        dev = executor.device
        self.max_rows = bmax = executor.buckets[-1]
        e64 = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        self.tokens = [e64(bmax, 1), e64(bmax, 1)]     # [Bmax, 1] tokens of a parity's steps
        self.next_start = [e64(bmax), e64(bmax)]       # [Bmax] next start positions
        self.payload = [e64(bmax, 1), e64(bmax, 1)]    # [Bmax, 1] D2H payload: tokens, NONFINITE rows marked
        num_spec = 0 if follower is None else follower.num_spec
        self.drafts = [e64(bmax, num_spec), e64(bmax, num_spec)]   # [Bmax, K] the follower's drafts
        self._ones = torch.ones(bmax, dtype=torch.int64, device=dev)   # [Bmax] valid tokens per row: 1
        self._start = e64(bmax)                        # [Bmax] prepare_decode's start output (greedy_verify's start)
        self._unused = e64(bmax)                       # num_valid / drafts inputs (read only for K > 0)
        self._no_drafts = e64(bmax, 0)                 # [Bmax, 0] greedy_verify's drafts: none
        self._pick_scratch = (e64(bmax), e64(bmax))    # greedy_verify's num_valid / next start (unread)
        vocab_size = next(iter(self.fwd.values())).logits.shape[-1]
        self._argmax_chunks = chunk_buffers(bmax, vocab_size, dev)   # greedy_verify's scratch
        # [N, W, prev (N), slot (N), block-table rows (N x W)]: the graphs hold its address
        self.staged = e64(2 + bmax * (2 + max_blocks))
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.parity = 0                                # parity of the next graph step
        self._read_ev: list = [None, None]             # last D2H of payload[parity] (an Event), per parity
        self._main = CurrentStream(dev)
        self._capture_all()

    # ---- start-up ----------------------------------------------------------------------------
    def _body(self, bucket: int, parity: int) -> None:
        from .triton_decode_prep import triton_prepare_decode
        g = self.fwd[bucket]
        a, m = g.fb.attn, g.fb.mamba
        dest = DecodeDest(g.fb.input_ids, g.fb.positions, a.slot_mapping, a.seq_lens, a.block_tables,
                          m.decode_slots, m.num_accepted)
        prev = PrevOutputs(self.tokens[1 - parity], self._unused, self.next_start[1 - parity],
                           self._unused[:, None])
        triton_prepare_decode(self.staged, 0, 0, prev, dest, block_size=self.block_size, num_spec=0,
                              start_out=self._start, drafts_out=None, next_start_out=self.next_start[parity],
                              header=True)
        _, logits = EagerExecutor.forward(self.ex, g.fb)
        # the argmax into tokens[q] and the payload (NONFINITE rows: sampler.nonfinite_rows' check)
        # in two Triton launches: greedy_verify with no drafts. The torch form (argmax, a gather,
        # isfinite, where, two copies) was seven launches, the argmax alone 8.9 us at 131072 ids
        # (H100, results/2026-11-26-spec-step-cost-draft-vocab-8b-h100.json). Its num_valid and
        # next start (start + 1, as prepare_decode's) go to scratch.
        greedy_verify(logits, self._no_drafts[:bucket], self._start[:bucket],
                      tokens_out=self.tokens[parity][:bucket], num_valid_out=self._pick_scratch[0][:bucket],
                      next_start_out=self._pick_scratch[1][:bucket], payload_out=self.payload[parity][:bucket],
                      chunks=self._argmax_chunks)
        if self.follower is not None:   # pad rows' appends go to the null slot's history (prepare_decode's slots)
            drafts = self.follower.propose(m.decode_slots[:bucket], self.tokens[parity][:bucket],
                                           self._ones[:bucket], self.next_start[parity][:bucket])
            self.drafts[parity][:bucket].copy_(drafts)                  # [B, K]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        keys = [(bucket, parity) for bucket in sorted(self.ex.buckets, reverse=True) for parity in (0, 1)]
        self.graphs, seconds, used = capture_step_graphs(keys, self._body, device=self.ex.device, pool=self.ex.pool,
                                                         staged=self.staged)
        logger.info("captured %d greedy step graphs (prepare + forward + argmax%s; B in %s, 2 parities) "
                    "in %.1fs, %.1f MiB", len(self.graphs), "" if self.follower is None else " + the drafter's follow",
                    list(self.ex.buckets), seconds, used / 2**20)

    # ---- the step (the fused plan of docs/design.md "The step as phases") ---------------------
    fused = True        # replay() prepares, runs the forward and samples: the runner only finishes

    def applies(self, step: StepRows, prev) -> bool:
        """A decode-only step whose rows all take the argmax, are at most max_rows and all have a
        previous output (``prev``: the runner's PrevStep). Keeps the rows it looked up for replay."""
        if not step.decode_only:
            return False
        req_ids = step.req_ids
        n = len(req_ids)
        if not 0 < n <= self.max_rows or prev is None:
            return False
        if prev.sampled.shape[1] != 1 or prev.drafts.shape[1]:
            # a spec engine (adaptive): only a step that verifies no drafts, after a step that kept
            # one token per row (the graphs read column 0 with accepted count 1)
            return False
        batch = self.batch
        rows = batch.rows_of(req_ids)
        if batch.temperature[rows].any() or batch.processed[rows].any() or (
                batch.num_logprob_rows and (batch.logprobs[rows] >= 0).any()):
            return False                                   # a row samples or processes its logits
        prev_idx = batch.prev_positions(req_ids)
        if (prev_idx < 0).any():
            return False                                   # the general path reports it
        self._rows, self._prev_idx = rows, prev_idx
        return True

    def replay(self, step: StepRows, prev, h2d: H2D, next_width: int = 0) -> FusedSpecStep:
        """Run the step ``applies`` accepted as one replay -> its outputs (width 0: tokens [N, 1],
        the payload [N, 1] with non-finite rows set to step_io.NONFINITE, the follower's drafts
        [N, K], K = 0 without one). ``next_width``: unused (the follower always drafts K)."""
        n = len(step.req_ids)
        rows, batch = self._rows, self.batch
        host, _ = batch.stage_decode(rows, self._prev_idx, header=True)
        if self.follower is not None:
            self.follower.before_replay()
        parity = self.parity
        main = self._main()
        if self._read_ev[parity] is not None:              # this parity's buffers are written below
            main.wait_event(self._read_ev[parity])
        if prev.sampled.data_ptr() != self.tokens[1 - parity].data_ptr():
            prev_rows = prev.sampled.shape[0]              # not this family's output: copy it in
            if self._read_ev[1 - parity] is not None:
                main.wait_event(self._read_ev[1 - parity])
            self.tokens[1 - parity][:prev_rows].copy_(prev.sampled[:, :1])
            self.next_start[1 - parity][:prev_rows].copy_(prev.next_start)
        h2d.begin_step()
        h2d.put_raw(host, out=self.staged)
        bucket = next(x for x in self.ex.buckets if x >= n)
        self.graphs[(bucket, parity)].replay()
        self.parity = 1 - parity
        out = self._views.get((parity, n))
        if out is None:
            out = self._views[(parity, n)] = FusedSpecStep(
                sampled=self.tokens[parity][:n], num_valid=self._ones[:n], next_start=self.next_start[parity][:n],
                drafts=self.drafts[parity][:n], rows=None, payload=self.payload[parity][:n], width=0)
        out.rows = rows
        return out

    def accepted_rows(self):
        """[N] the batch rows (host) of the step ``applies`` last accepted."""
        return self._rows

    def bind(self, batch: InputBatch) -> None:
        """The runner's input batch (the graphs read its staged rows); called once by the runner."""
        self.batch = batch

    def read_by(self, event) -> None:
        """The D2H copy of the tokens the last ``step`` wrote finishes at ``event`` (None: no
        side-stream reader); the next write of that parity's buffers waits for it."""
        self._read_ev[1 - self.parity] = event


def make_greedy_graphs(executor, *, num_spec: int, block_size: int, max_blocks: int,
                       follower=None) -> GreedyStepGraphs | None:
    """Greedy step graphs where they apply (CUDA graphs on, the Triton input preparation
    available; with speculation, only where steps may verify no drafts (adaptive, width-1 graphs)
    and the drafter can follow such a step inside them (``follower``: the n-gram drafter's,
    ``spec_graphs.greedy_follower``)); the choice is logged once either way."""
    if not isinstance(executor, CudaGraphExecutor):
        return None
    if num_spec and not (follower is not None and 1 in executor.graphs_by_width):
        logger.info("greedy step graphs: off (speculation: steps without drafts are %s)",
                    "not adaptive" if 1 not in executor.graphs_by_width
                    else "followed by a drafter that cannot follow inside them (a model drafter, or n-gram "
                         "without its Triton kernel)")
        return None
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("prepare_decode", executor.device) != "triton":
        logger.warning("greedy step graphs: off (the Triton prepare_decode kernel is unavailable); "
                       "greedy decode steps take the general path")
        return None
    try:
        return GreedyStepGraphs(executor, block_size=block_size, max_blocks=max_blocks, follower=follower)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:   # e.g. no memory left for capture
        logger.warning("greedy step graphs: off (capture failed: %s: %s); greedy decode steps take "
                       "the general path", type(exc).__name__, exc)
        torch.cuda.empty_cache()
        return None
