"""Whole greedy verify steps as CUDA graph replays: input preparation, forward, verification, the
step's advance, the drafter's proposal and the D2H payload, one replay per step.

A K > 0 step on the general path is ~20 host calls (staging, ``prepare_decode``, the forward
replay, the greedy verification, the valid counts and next starts, the non-finite check, the
proposal, the payload, the copy), about twice the host time of a fused greedy step
(``greedy_graphs.py``); a model-based drafter adds its own launches and copies. On a small model
the step is host-bound, so that is the spec step's cost. ``SpecStepGraphs`` captures, per bucket
B, step width k (drafts per row: the executor's captured widths, K and, with adaptive
speculation, the narrower ones) and parity q:

    prepare_decode(header mode; previous outputs from the parity 1-q buffers, accepted counts
    gathered) -> the forward graph body of width 1+k -> greedy verification writing tokens, valid
    counts, next starts and the payload [tokens | verified drafts] (non-finite rows marked) into
    the parity q buffers (``triton_greedy_verify.py``, two launches) -> the drafter's proposal (K
    drafts for the next step; the runner keeps the width its policy picks) into the same buffers

so the host's calls are the subclass's ``_before_replay`` (usually nothing), one H2D of the staged
array, one replay and the D2H of the payload, as for a greedy step. Parities, waits on the D2H of a
parity's payload and the copy-in of a previous step that did not come from these graphs work as
in ``greedy_graphs.py``. Taken only for decode-only steps whose rows are all greedy and a width
captured here. Width 0 (adaptive speculation resting every row) is captured too
(``verifies_no_drafts``): such a step is a one-token forward, its argmax and the proposal. The
model-based drafters must follow every step to keep their caches (the MTP layers' KV, the draft
model's states); without it those steps fell to the general path (on the bench-large target at
batch 8, 55 of a draft-model run's 127 steps, at the general path's host cost). A resting step
whose next step rests too (the policy's next width, known on the host before the replay, is 0)
replays a follow-only graph where the drafter has one (``follows_without_drafting``: the MTP
KV of the step's tokens, the draft model's caches, no drafts): proposing K there cost a resting MTP
step 1.81x a greedy step on random weights (H200, results/2026-11-29-spec-adaptive-two-rates-h200.md). The n-gram
drafter's width-0 steps after a width-0 step are the greedy graphs' (``greedy_graphs.py``, asked
first, with the n-gram kernel captured after the argmax); the first one after a drafting step is this
plan's, since the greedy graphs read one column of previous outputs.
Subclasses: ``ngram_graphs.NgramStepGraphs`` (the n-gram Triton kernel),
``mtp_step_graphs.MTPStepGraphs`` (the MTP layers), ``draft_model_step_graphs.DraftModelStepGraphs``
(the draft model's forwards).
"""
from __future__ import annotations

import logging

import torch

from .decode_prep import DecodeDest, PrevOutputs
from .graphs import CudaGraphExecutor, EagerExecutor, capture_step_graphs
from .input_batch import InputBatch
from .step_io import StepRows
from .transfer import H2D, CurrentStream
from .triton_greedy_verify import chunk_buffers, greedy_verify

logger = logging.getLogger("hybrid_engine")


class FusedSpecStep:
    """What one replay produced, in its step rows (views of the parity's buffers)."""
    __slots__ = ("sampled", "num_valid", "next_start", "drafts", "rows", "payload", "width")

    def __init__(self, *, sampled, num_valid, next_start, drafts, rows, payload, width):
        self.sampled = sampled          # [N, 1+k] int64, -1 after the last valid token
        self.num_valid = num_valid      # [N] int64
        self.next_start = next_start    # [N] int64
        self.drafts = drafts            # [N, K] int64 the drafter's drafts for the next step (-1 = none)
        self.rows = rows                # [N] batch rows (host)
        self.payload = payload          # [N, 1+2k] tokens, then the verified drafts; NONFINITE rows marked
        self.width = width              # k: drafts each row verified (the runner's "width": drafts, not tokens)


class SpecStepGraphs:
    """A greedy verify step replayed whole, one CUDA graph per (bucket, width, parity). A drafter's
    subclass supplies the proposal (``_propose``, captured in the same graph) and may act on the
    host before a replay (``_before_replay``)."""
    fused = True          # replay() runs the whole step
    proposes = True       # ... the drafter's proposal included: the runner only finishes it
    name = "spec"         # in the capture log line
    verifies_no_drafts = False   # also capture width 0 (model drafters: see the module docstring)
    follows_without_drafting = False   # width 0 also as a follow-only graph (``_follow``) for a next width 0

    def __init__(self, executor: CudaGraphExecutor, drafter, *, num_spec: int, widths: tuple[int, ...],
                 block_size: int, max_blocks: int, forced_acceptance_rate: float | None = None):
        """``widths``: the draft counts a step may verify (``adaptive.draft_counts``; a count k
        runs the executor's forward of 1 + k tokens per row). Counts without a captured forward,
        and 0 unless ``verifies_no_drafts``, are left to other plans. ``forced_acceptance_rate``
        (benchmark only): verification accepts each draft on a coin of that probability, drawn in
        the verification kernel with the general path's keys (``spec.rejection.forced_accept_mask``),
        so forced runs measure this plan, not the general path."""
        self.ex, self.drafter, self.block_size = executor, drafter, block_size
        self.forced_rate = forced_acceptance_rate
        self.num_spec = K = num_spec
        self.draft_counts = tuple(k for k in widths if (k > 0 or (self.verifies_no_drafts and K > 0))
                                  and 1 + k in executor.graphs_by_width)
        if not self.draft_counts:
            raise ValueError(f"no captured forward width among {widths}")
        # resting steps followed by a resting step have their own (follow-only) graphs
        self.follow_only = self.follows_without_drafting and 0 in self.draft_counts
        self.batch: InputBatch | None = None
        self._rows = self._prev_idx = None
        dev = executor.device
        self.max_rows = bmax = executor.buckets[-1]
        e64 = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        # per parity (steps alternate between the two buffers of each list)
        self.tokens = [e64(bmax, 1 + K), e64(bmax, 1 + K)]   # [Bmax, 1+K] sampled tokens
        self.num_valid = [e64(bmax), e64(bmax)]              # [Bmax] valid tokens per row
        self.next_start = [e64(bmax), e64(bmax)]             # [Bmax] next start positions
        self.drafts = [e64(bmax, K), e64(bmax, K)]           # [Bmax, K] drafts for the next step
        # per draft count k: [Bmax, k] drafts verified (prepare_decode's output); per (k, parity):
        # [Bmax, 1+2k] D2H payloads
        self.verified_drafts = {k: e64(bmax, k) for k in self.draft_counts}
        self.payload = {(k, parity): e64(bmax, 1 + 2 * k) for k in self.draft_counts for parity in (0, 1)}
        self._start = e64(bmax)                              # [Bmax] prepare_decode's start output
        self._k0_next_start = e64(bmax)                      # [Bmax] prepare_decode's width-0 output (unused)
        self.staged = e64(2 + bmax * (2 + max_blocks))       # [N, W, prev, slot, block rows]
        vocab_size = next(iter(executor.graphs_by_width[1 + self.draft_counts[0]].values())).logits.shape[-1]
        self._argmax_chunks = chunk_buffers(bmax * (1 + K), vocab_size, dev)   # greedy_verify's scratch
        # (bucket, k, parity, drafting): drafting False only at k = 0 (``follow_only``)
        self.graphs: dict[tuple[int, int, int, bool], torch.cuda.CUDAGraph] = {}
        self._views: dict[tuple, FusedSpecStep] = {}                         # (parity, N, k)
        self.parity = 0                                      # parity of the next graph step
        self._read_ev: list = [None, None]                   # last D2H of a parity's payload (an Event)
        self._main = CurrentStream(dev)

    # ---- what a drafter's subclass supplies --------------------------------------------------
    def _propose(self, g, bucket: int, hidden, sampled, num_valid, next_start) -> torch.Tensor:
        """Captured after verification: the drafts [bucket, K] for the next step from this step's
        forward batch ``g.fb``, target hidden states [bucket * (1+k), D] and outcome (sampled
        [bucket, 1+k], num_valid [bucket], next_start [bucket])."""
        raise NotImplementedError

    def _follow(self, g, bucket: int, hidden, sampled, num_valid, next_start) -> None:
        """Captured after verification in the follow-only graphs (``follows_without_drafting``):
        the drafter's caches follow the step (as ``_propose`` leaves them, drafts aside); no drafts."""
        raise NotImplementedError

    def _before_replay(self) -> None:
        """Host work a replay needs first (e.g. the drafter's pending slot resets)."""

    # ---- start-up ----------------------------------------------------------------------------
    def _body(self, bucket: int, num_drafts: int, parity: int, drafting: bool = True) -> None:
        from .triton_decode_prep import triton_prepare_decode
        k, tokens_per_row = num_drafts, 1 + num_drafts
        g = self.ex.graphs_by_width[tokens_per_row][bucket]
        a, m = g.fb.attn, g.fb.mamba
        dest = DecodeDest(g.fb.input_ids, g.fb.positions, a.slot_mapping, a.seq_lens, a.block_tables,
                          m.decode_slots, m.num_accepted)
        # the previous tokens have 1+K columns: prepare_decode gathers the accepted counts
        other = 1 - parity
        prev = PrevOutputs(self.tokens[other], self.num_valid[other], self.next_start[other],
                           self.drafts[other][:, :k])
        verified = self.verified_drafts[k]                                   # [Bmax, k]
        # (at width 0 prepare_decode also writes start + 1; verification writes the real next starts)
        triton_prepare_decode(self.staged, 0, 0, prev, dest, block_size=self.block_size, num_spec=k,
                              start_out=self._start, drafts_out=verified,
                              next_start_out=None if k else self._k0_next_start, header=True)
        hidden, logits = EagerExecutor.forward(self.ex, g.fb)                # [B * tokens_per_row, D / V]
        # verification writes the step's outputs into the parity buffers (docs/design.md invariant 7:
        # tokens are the target's argmax up to the first rejected draft, then -1; under forced
        # acceptance, a benchmark option, the drafts of the passed coins instead)
        sampled = self.tokens[parity][:bucket, :tokens_per_row]             # [B, tokens_per_row]
        num_valid, next_start = self.num_valid[parity][:bucket], self.next_start[parity][:bucket]
        # forced acceptance: the general path's coins (keys: the rows' slots), drawn in the kernel
        forced_kwargs = {} if self.forced_rate is None else dict(forced_rate=self.forced_rate,
                                                                 forced_keys=m.decode_slots[:bucket])
        greedy_verify(logits, verified[:bucket], self._start[:bucket], tokens_out=sampled, num_valid_out=num_valid,
                      next_start_out=next_start, payload_out=self.payload[(k, parity)][:bucket],
                      chunks=self._argmax_chunks, **forced_kwargs)
        if not drafting:                  # the next step rests too: the drafter only follows this one
            self._follow(g, bucket, hidden, sampled, num_valid, next_start)
            return                        # drafts[parity] is not written: the next step reads none of it
        drafts = self._propose(g, bucket, hidden, sampled, num_valid, next_start)   # [B, K]
        self.drafts[parity][:bucket].copy_(drafts)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        keys = [(bucket, k, parity, True) for k in sorted(self.draft_counts, reverse=True)
                for bucket in sorted(self.ex.buckets, reverse=True) for parity in (0, 1)]
        if self.follow_only:
            keys += [(bucket, 0, parity, False) for bucket in sorted(self.ex.buckets, reverse=True)
                     for parity in (0, 1)]
        self.graphs, seconds, used = capture_step_graphs(keys, self._body, device=self.ex.device, pool=self.ex.pool,
                                                         staged=self.staged)
        logger.info("captured %d %s step graphs (prepare + forward + verify + propose; B in %s, k in %s, "
                    "2 parities%s) in %.1fs, %.1f MiB", len(self.graphs), self.name, list(self.ex.buckets),
                    list(self.draft_counts), "; k = 0 also follow-only" if self.follow_only else "",
                    seconds, used / 2**20)

    # ---- the step ---------------------------------------------------------------------------
    def applies(self, step: StepRows, prev) -> bool:
        """A decode-only step of greedy rows (at most max_rows, each with a previous output) that
        verifies a draft count captured here."""
        if not step.decode_only or prev is None:
            return False
        req_ids = step.req_ids
        n = len(req_ids)
        if not 0 < n <= self.max_rows or prev.drafts.shape[1] not in self.verified_drafts:
            return False
        batch = self.batch
        rows = batch.rows_of(req_ids)
        if batch.temperature[rows].any() or batch.processed[rows].any() or (
                batch.num_logprob_rows and (batch.logprobs[rows] >= 0).any()):
            return False                                   # a row samples, processes or wants logprobs
        prev_idx = batch.prev_positions(req_ids)
        if (prev_idx < 0).any():
            return False
        self._rows, self._prev_idx = rows, prev_idx
        return True

    def replay(self, step: StepRows, prev, h2d: H2D, next_width: int) -> FusedSpecStep:
        """Run the step ``applies`` accepted as one replay. ``next_width``: the drafts the next step
        verifies per row (the runner's policy); a resting step followed by a resting step replays
        the follow-only graph where there is one (its ``drafts`` are then [N, K] of stale values:
        the runner keeps none of them)."""
        n, num_drafts = len(step.req_ids), prev.drafts.shape[1]
        rows, batch = self._rows, self.batch
        host, _ = batch.stage_decode(rows, self._prev_idx, header=True)
        self._before_replay()
        parity, other = self.parity, 1 - self.parity
        main = self._main()
        if self._read_ev[parity] is not None:              # payload[., parity] is written below
            main.wait_event(self._read_ev[parity])
        if prev.sampled.data_ptr() != self.tokens[other].data_ptr():
            prev_rows, prev_cols = prev.sampled.shape      # not this family's output: copy it in
            self.tokens[other][:prev_rows, :prev_cols].copy_(prev.sampled)
            self.num_valid[other][:prev_rows].copy_(prev.num_valid)
            self.next_start[other][:prev_rows].copy_(prev.next_start)
            self.drafts[other][:prev_rows, :num_drafts].copy_(prev.drafts)
        h2d.begin_step()
        h2d.put_raw(host, out=self.staged)
        bucket = next(x for x in self.ex.buckets if x >= n)
        drafting = num_drafts > 0 or next_width > 0 or not self.follow_only
        self.graphs[(bucket, num_drafts, parity, drafting)].replay()
        self.parity = other
        key = (parity, n, num_drafts)
        out = self._views.get(key)
        if out is None:
            out = self._views[key] = FusedSpecStep(
                sampled=self.tokens[parity][:n, :1 + num_drafts], num_valid=self.num_valid[parity][:n],
                next_start=self.next_start[parity][:n], drafts=self.drafts[parity][:n], rows=None,
                payload=self.payload[(num_drafts, parity)][:n], width=num_drafts)
        out.rows = rows
        return out

    def accepted_rows(self):
        """[N] the batch rows (host) of the step ``applies`` last accepted."""
        return self._rows

    def bind(self, batch: InputBatch) -> None:
        self.batch = batch

    def read_by(self, event) -> None:
        """The D2H of the last replay's payload finishes at ``event``; that parity's next write waits."""
        self._read_ev[1 - self.parity] = event


def make_spec_graphs(executor, drafter, **kw) -> SpecStepGraphs | None:
    """The fused verify-step plan of the engine's drafter (n-gram, MTP, draft model); None
    without speculation or CUDA graphs."""
    if not isinstance(executor, CudaGraphExecutor) or not kw.get("num_spec"):
        return None
    from hybrid_engine.spec.drafters.draft_model import DraftModelDrafter
    from hybrid_engine.spec.drafters.mtp import MTPDrafter
    from hybrid_engine.spec.drafters.ngram import NgramDrafter

    from .draft_model_step_graphs import make_draft_model_step_graphs
    from .mtp_step_graphs import make_mtp_step_graphs
    from .ngram_graphs import make_ngram_graphs
    factory = {NgramDrafter: make_ngram_graphs, MTPDrafter: make_mtp_step_graphs,
               DraftModelDrafter: make_draft_model_step_graphs}.get(type(drafter))
    return None if factory is None else factory(executor, drafter, **kw)


def greedy_follower(drafter):
    """What the greedy step graphs capture after the argmax to let the drafter follow a resting
    step (``greedy_graphs.py``): the n-gram drafter's kernel; None for a drafter that must follow
    with a model (MTP, draft model: their resting steps are this plan's width-0 graphs) or none."""
    from hybrid_engine.spec.drafters.ngram import NgramDrafter

    from .ngram_graphs import make_ngram_follower
    return make_ngram_follower(drafter) if type(drafter) is NgramDrafter else None


def build_step_graphs(cls, label: str, executor, drafter, **kw) -> SpecStepGraphs | None:
    """``cls(executor, drafter, **kw)`` (a subclass captures its graphs when built), or None with a
    warning naming ``label`` where the Triton input preparation is unavailable or capture fails:
    the drafter's verify steps then take the general path."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("prepare_decode", executor.device) != "triton":
        logger.warning("%s step graphs: off (the Triton prepare_decode kernel is unavailable)", label)
        return None
    try:
        return cls(executor, drafter, **kw)
    except (RuntimeError, ValueError, torch.cuda.OutOfMemoryError) as exc:
        logger.warning("%s step graphs: off (%s: %s); %s verify steps take the general path",
                       label, type(exc).__name__, exc, label)
        torch.cuda.empty_cache()
        return None
