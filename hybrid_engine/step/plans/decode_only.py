"""Decode-only plan: every row of the step decodes (K = 0) or verifies its drafts (K > 0)."""
from __future__ import annotations

import numpy as np
import torch

from ..decode_prep import DecodeDest, PrevOutputs, prepare_decode
from ..forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
from ..step_io import PrevStep, SpecInputs, StepInputs, StepRows
from .base import StepPlan, StepResources, draft_width, require_prev
from .staging import SAMPLING_FIELDS, sampling_tensors


class DecodeOnlyPlan(StepPlan):
    """One staged array (prev index, slot, block-table rows) and one ``prepare_decode`` launch that
    writes every input, straight into a CUDA graph bucket's buffers when the executor has one. The
    other per-step tensors of such a step are constants of the row count, built once."""

    def __init__(self, res: StepResources):
        self.res = res

    def applies(self, step: StepRows, prev: PrevStep | None) -> bool:
        return step.decode_only

    def prepare(self, step: StepRows, prev: PrevStep | None) -> StepInputs:
        res = self.res
        b, consts, dev = res.batch, res.consts, res.device
        k = draft_width(prev, res.num_spec)                      # this step's drafts per row
        req_ids = step.req_ids
        tokens_per_row, n = 1 + k, len(req_ids)
        rows = b.rows_of(req_ids)
        prev_idx = b.prev_positions(req_ids)
        require_prev(prev, prev_idx)
        host, block_cols = b.stage_decode(rows, prev_idx)
        random_np = b.temperature[rows] > 0
        res.h2d.begin_step()
        staged_sampling = None
        if random_np.any():
            staged_sampling = dict(zip(SAMPLING_FIELDS, res.h2d.put(
                b.temperature[rows], b.top_k[rows], b.top_p[rows], b.min_p[rows], b.seed[rows])))
            staged_sampling["sample_rows_p"] = consts.empty_i64
        staged = res.h2d.put_raw(host)
        got = res.executor.decode_dest(n, tokens_per_row)
        if got is None:
            fb, dest = self._fresh_decode_batch(n, block_cols, self._max_seq_len(step), tokens_per_row)
        else:
            dest, fb = got
        res.scratch.next_step()
        start = res.scratch.i64("start", n)
        drafts = torch.empty(n, k, dtype=torch.int64, device=dev) if k else consts.no_drafts(n)
        # K = 0: every row yields exactly one token, so its next start is known before sampling
        next_start = None if k else res.scratch.i64("next_start", n)
        prev_outputs = PrevOutputs(sampled=prev.sampled, num_valid=prev.num_valid, next_start=prev.next_start,
                                   drafts=prev.drafts)
        prepare_decode(staged, n, block_cols, prev_outputs, dest, block_size=res.block_size, num_spec=k, start_out=start, drafts_out=drafts,
                       next_start_out=next_start)
        if staged_sampling is None:
            sampling_all = sampling_decode = consts.greedy_sampling(n)
        else:
            sampling_all, sampling_decode, _ = sampling_tensors(b, consts, staged_sampling, rows, n,
                                                                np.zeros(0, np.int64), random_np)
        spec = None
        if res.num_spec:                                         # a spec engine verifies, even 0 drafts
            draft_probs = prev.draft_probs[staged[:n]] if prev.draft_probs is not None else None
            spec = SpecInputs(drafts=drafts, draft_probs=draft_probs, sampling_all=sampling_all)
        return StepInputs(
            fb=fb, num_decode=n, num_prefill=0, start=start, num_tokens=consts.full(n, tokens_per_row),
            backup=None, slots=fb.mamba.decode_slots, sample_rows_p=consts.empty_i64,
            sample_pos_p=consts.empty_i64, next_input_ids=consts.full(n * tokens_per_row, -1),
            is_decode=consts.full(n, 1, torch.bool), query_start_loc=consts.qsl64(n, tokens_per_row),
            sampling_decode=sampling_decode, sampling_prefill=None, rows_sampling_np=rows, spec=spec,
            next_start=next_start)

    def _max_seq_len(self, step: StepRows) -> int:
        """An upper bound of every row's sequence length after this step (eager attention only)."""
        tokens_per_row = 1 + self.res.num_spec
        if step.order is None:
            return int(step.steady.start_pos.max()) + step.steady.num_tokens
        return max(r.start_pos + tokens_per_row for r in step.order)

    def _fresh_decode_batch(self, n: int, block_cols: int, max_seq: int,
                            tokens_per_row: int) -> tuple[ForwardBatch, DecodeDest]:
        """Eager executor: new buffers for a decode-only batch (R = N rows, W = block_cols block-table
        columns)."""
        res = self.res
        dev, consts = res.device, res.consts
        e64 = lambda m: torch.empty(m, dtype=torch.int64, device=dev)  # noqa: E731
        num_tokens = n * tokens_per_row
        dest = DecodeDest(input_ids=e64(num_tokens), positions=e64(num_tokens), slot_mapping=e64(num_tokens),
                          seq_lens=torch.empty(n, dtype=torch.int32, device=dev),
                          block_tables=torch.empty(n, block_cols, dtype=torch.int32, device=dev),
                          decode_slots=e64(n), num_accepted=e64(n))
        fb = ForwardBatch(
            input_ids=dest.input_ids, positions=dest.positions,
            attn=AttnMetadata(query_start_loc=consts.qsl32(n, tokens_per_row), seq_lens=dest.seq_lens,
                              block_tables=dest.block_tables, slot_mapping=dest.slot_mapping,
                              max_query_len=tokens_per_row, max_seq_len=max_seq),
            mamba=MambaMetadata(num_decode_rows=n, decode_len=tokens_per_row, decode_slots=dest.decode_slots,
                                num_accepted=dest.num_accepted, prefill_query_start_loc=consts.zero_i64_1,
                                prefill_qsl_cpu=(0,), prefill_slots=consts.empty_i64,
                                has_initial_state=consts.empty_bool),
            logits_indices=consts.arange(n * tokens_per_row))
        return fb, dest
