"""Model runner: update batch -> prepare inputs -> forward -> sample/verify -> propose -> D2H.

``execute`` launches one step's device work and returns a handle at once; the only wait is the
caller's, on the handle, one step later. Decode rows take their input tokens, positions and Mamba
accepted counts from the previous step's device outputs, gathered through ``prev_positions``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spec.drafters import DraftContext, Drafter
from spec.rejection import rejection_sample

from .forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
from .graphs import EagerExecutor
from .input_batch import InputBatch
from .models.nemotron_h import Caches
from .sampler import SamplingTensors, sample
from .scheduler_output import ModelRunnerOutput, ScheduledRow, SchedulerOutput
from .transfer import D2HCopy, H2D


@dataclass(frozen=True)
class PrevStep:
    """Device outputs of the previous step, in its step-row space (read only via prev_positions)."""
    sampled: torch.Tensor        # [B, 1+K] int64, -1 after the last valid token
    num_valid: torch.Tensor      # [B] int64
    next_start: torch.Tensor     # [B] int64 exact position of each row's next input token
    drafts: torch.Tensor         # [B, K] int64, -1 = no draft
    draft_probs: torch.Tensor | None  # [B, K, V] float32


@dataclass(frozen=True)
class StepInputs:
    fb: ForwardBatch
    start: torch.Tensor          # [B] int64 exact start position per step row
    num_tokens: torch.Tensor     # [B] int64 query length per step row
    drafts: torch.Tensor         # [N_d, K] drafts verified this step (-1 = none)
    draft_probs: torch.Tensor | None
    backup: torch.Tensor         # [B] int64 backup token per row
    slots: torch.Tensor          # [B] int64
    sample_rows_p: torch.Tensor  # [R_p] int64 step rows of prefill rows that sample
    next_input_ids: torch.Tensor # [T] int64 token after each input token where the host knows it, else -1
    st_decode: SamplingTensors | None
    st_prefill: SamplingTensors | None
    st_all: SamplingTensors | None   # every step row (drafters sample with it)


class StepHandle:
    def __init__(self, sched: SchedulerOutput, req_ids: tuple[str, ...], copy: D2HCopy | None,
                 error: BaseException | None = None):
        self.sched, self.req_ids, self._copy, self.error = sched, req_ids, copy, error

    def _output(self, host) -> ModelRunnerOutput:
        return ModelRunnerOutput(self.sched.step_id, self.req_ids, host["sampled"], host["num_valid"],
                                 host["num_drafts"])

    def result(self) -> ModelRunnerOutput:
        return self._output(self._copy.wait())

    async def result_async(self) -> ModelRunnerOutput:
        return self._output(await self._copy.wait_async())


class ModelRunner:
    def __init__(self, model, caches: Caches, drafter: Drafter, *, max_num_seqs: int, max_model_len: int,
                 block_size: int, max_blocks: int, num_spec: int, device: torch.device):
        self.model, self.caches, self.drafter = model, caches, drafter
        self.executor = EagerExecutor(model, caches)     # replaced by a CudaGraphExecutor on CUDA
        self.device, self.block_size, self.num_spec = device, block_size, num_spec
        self.batch = InputBatch(max_num_seqs, max_model_len + 2 * (1 + num_spec), max_blocks)
        self.h2d = H2D(device)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.prev: PrevStep | None = None

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepHandle:
        order = self._update_batch(sched)
        req_ids = tuple(r.req_id for r in order)
        try:
            inp = self._prepare(order)
            hidden, logits = self.executor.forward(inp.fb)
            sampled = self._sample(logits, inp)
        except BaseException:
            self.prev = None
            raise
        num_valid = (sampled != -1).sum(1)                                   # [B], invariant 7
        n_dec = inp.drafts.shape[0]
        next_start = inp.start + torch.cat([num_valid[:n_dec], inp.num_tokens[n_dec:]])
        last_idx = (num_valid - 1).clamp(min=0)
        last_tok = sampled.gather(1, last_idx[:, None]).squeeze(1)
        ctx = DraftContext(
            req_ids=req_ids, slots=inp.slots, sampled=sampled, num_valid=num_valid,
            input_token=torch.where(num_valid > 0, last_tok, inp.backup), input_pos=next_start,
            hidden=hidden, token_index=self._token_index(inp, last_idx, n_dec),
            is_decode=torch.arange(len(order), device=self.device) < n_dec,
            query_start_loc=inp.fb.attn.query_start_loc.long(), input_ids=inp.fb.input_ids,
            positions=inp.fb.positions, next_input_ids=inp.next_input_ids, forward_batch=inp.fb, sampling=inp.st_all, block_size=self.block_size)
        drafts, draft_probs = self.drafter.propose(ctx)
        self.prev = PrevStep(sampled, num_valid, next_start, drafts, draft_probs)
        self.batch.prev_req_id_to_index = {rid: i for i, rid in enumerate(req_ids)}
        rows = np.array([self.batch.req_id_to_row[r.req_id] for r in order if r.samples], dtype=np.int64)
        self.batch.append_placeholders(rows)
        num_drafts = torch.zeros(len(order), dtype=torch.int64, device=self.device)
        if n_dec and self.num_spec:
            num_drafts[:n_dec] = (inp.drafts != -1).sum(1)
        copy = D2HCopy({"sampled": sampled, "num_valid": num_valid, "num_drafts": num_drafts},
                       self.copy_stream)
        return StepHandle(sched, req_ids, copy)

    def _token_index(self, inp: StepInputs, last_idx: torch.Tensor, n_dec: int) -> torch.Tensor:
        """Index into hidden of the token whose logits produced each row's last valid sample."""
        qsl = inp.fb.attn.query_start_loc.long()
        end = qsl[1:] - 1                                          # prefill rows: last token
        dec = qsl[:-1] + last_idx                                  # verify rows: the accepted prefix end
        return torch.cat([dec[:n_dec], end[n_dec:]])

    # ------------------------------------------------------------------------------------------
    def _update_batch(self, sched: SchedulerOutput) -> list[ScheduledRow]:
        b = self.batch
        for rid in sched.removed_req_ids:
            b.remove_request(rid)
        for new in sched.new_requests:
            b.remove_request(new.req_id)           # resumed after preemption: start from a clean row
            b.add_request(new)
            self.drafter.add_request(new.slot, new.token_ids)
        b.condense()
        order = [r for r in sched.rows if r.is_decode] + [r for r in sched.rows if not r.is_decode]
        for r in order:
            b.set_blocks(b.req_id_to_row[r.req_id], r.block_ids)
        return order

    def _prepare(self, order: list[ScheduledRow]) -> StepInputs:
        self.h2d.begin_step()
        b, bs, k = self.batch, self.block_size, self.num_spec
        s = 1 + k
        dec = [r for r in order if r.is_decode]
        pre = order[len(dec):]
        nd, npf = len(dec), len(pre)
        rows = np.array([b.req_id_to_row[r.req_id] for r in order], dtype=np.int64)
        rows_p = rows[nd:]
        # prefill rows: everything is exact on the host
        start_p = np.array([r.start_pos for r in pre], dtype=np.int64)
        len_p = np.array([r.num_tokens for r in pre], dtype=np.int64)
        pos_p = np.concatenate([np.arange(a, a + n) for a, n in zip(start_p, len_p)]) if npf else np.zeros(0, np.int64)
        row_of_tok = np.repeat(rows_p, len_p)
        ids_p = b.token_ids_cpu[row_of_tok, pos_p]
        next_ids_p = b.token_ids_cpu[row_of_tok, pos_p + 1]          # -1 where not known on the host
        slot_map_p = b.block_table[row_of_tok, pos_p // bs].astype(np.int64) * bs + pos_p % bs
        qsl = np.concatenate([[0], np.arange(1, nd + 1) * s, nd * s + np.cumsum(len_p)]).astype(np.int32)
        samples_p = np.array([r.samples for r in pre], dtype=bool)
        logits_idx = np.concatenate([np.arange(nd * s), (qsl[nd + 1:] - 1)[samples_p]]).astype(np.int64)
        max_blocks = int(b.num_blocks[rows].max()) if len(rows) else 1
        bt = np.ascontiguousarray(b.block_table[rows, :max(max_blocks, 1)])
        prev_idx = b.prev_positions([r.req_id for r in dec])
        if nd and (self.prev is None or (prev_idx < 0).any()):
            raise RuntimeError("decode row without a previous step output (scheduler/runner out of sync)")
        qsl_p_cpu = tuple(int(x) for x in np.concatenate([[0], np.cumsum(len_p)]))
        sample_rows_p = nd + np.flatnonzero(samples_p)
        (ids_p_t, pos_p_t, slot_p_t, qsl_t, logits_idx_t, bt_t, prev_t, start_p_t, len_p_t, slots_t, backup_t,
         srp_t, next_p_t) = self.h2d.put(ids_p, pos_p, slot_map_p, qsl, logits_idx, bt, prev_idx, start_p, len_p,
                                         b.slot[rows], b.backup_tokens(rows), sample_rows_p, next_ids_p)
        dev = self.device
        if nd:
            p = self.prev
            a_prev = p.num_valid[prev_t].clamp(min=1)                          # Mamba accepted count
            last = p.sampled[prev_t].gather(1, (a_prev - 1)[:, None])          # [nd, 1]
            drafts = p.drafts[prev_t] if k else torch.empty(nd, 0, dtype=torch.int64, device=dev)
            draft_probs = p.draft_probs[prev_t] if (k and p.draft_probs is not None) else None
            start_d = p.next_start[prev_t]
            ids_d = torch.cat([last, drafts.clamp(min=0)], 1).reshape(-1)
            pos_d = start_d[:, None] + torch.arange(s, device=dev)
            slot_d = (bt_t[:nd].long().gather(1, pos_d // bs) * bs + pos_d % bs).reshape(-1)
        else:
            a_prev = start_d = torch.zeros(0, dtype=torch.int64, device=dev)
            drafts, draft_probs = torch.empty(0, k, dtype=torch.int64, device=dev), None
            ids_d = slot_d = pos_d = a_prev
        start = torch.cat([start_d, start_p_t])
        num_tokens = torch.cat([torch.full((nd,), s, dtype=torch.int64, device=dev), len_p_t])
        seq_lens = (start + num_tokens).to(torch.int32)
        max_seq = int(max([r.start_pos + r.num_tokens for r in order], default=1))
        fb = ForwardBatch(
            input_ids=torch.cat([ids_d, ids_p_t]),
            positions=torch.cat([pos_d.reshape(-1), pos_p_t]),
            attn=AttnMetadata(qsl_t, seq_lens, bt_t, torch.cat([slot_d, slot_p_t]),
                              max_query_len=int(max([r.num_tokens for r in order], default=1)),
                              max_seq_len=max_seq),
            mamba=MambaMetadata(nd, s, slots_t[:nd], a_prev, qsl_t[nd:].long() - nd * s, qsl_p_cpu,
                                slots_t[nd:], start_p_t > 0),
            logits_indices=logits_idx_t)
        next_ids = torch.cat([torch.full((nd * s,), -1, dtype=torch.int64, device=dev), next_p_t])
        st_all, st_decode, st_prefill = self._sampling(rows, nd, sample_rows_p, srp_t)
        return StepInputs(fb, start, num_tokens, drafts, draft_probs, backup_t, slots_t, srp_t, next_ids,
                          st_decode, st_prefill, st_all if k else None)

    def _sampling(self, rows: np.ndarray, nd: int, sample_rows_p: np.ndarray, sample_rows_p_t: torch.Tensor):
        """Sampling parameters of every step row in one transfer -> (all rows, decode rows [:nd],
        sampling prefill rows); the subsets are device slices/gathers, their host flags from numpy."""
        b = self.batch
        host = (b.temperature[rows], b.top_k[rows], b.top_p[rows], b.min_p[rows], b.seed[rows])
        dev = self.h2d.put(*host)
        rand = host[0] > 0
        filt = ((host[1] > 0) | (host[2] < 1) | (host[3] > 0)) & rand

        def subset(host_sel, dev_sel) -> SamplingTensors | None:
            if not rand[host_sel].size:
                return None
            t, tk, tp, mp, sd = (x[dev_sel] for x in dev)
            return SamplingTensors(temperature=t, top_k=tk, top_p=tp, min_p=mp, seed=sd,
                                   all_greedy=not rand[host_sel].any(), any_filter=bool(filt[host_sel].any()))
        return (subset(slice(None), slice(None)), subset(slice(0, nd), slice(0, nd)),
                subset(sample_rows_p, sample_rows_p_t))

    def _sample(self, logits: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        k = self.num_spec
        nd = inp.drafts.shape[0]
        out = torch.full((inp.start.shape[0], 1 + k), -1, dtype=torch.int64, device=self.device)
        if nd:
            ld = logits[:nd * (1 + k)].view(nd, 1 + k, -1)
            pos = inp.start[:nd] + 1                                # position of the first produced token
            if k:
                out[:nd] = rejection_sample(ld, inp.drafts, inp.draft_probs, inp.st_decode, pos)
            else:
                out[:nd, 0] = sample(ld[:, 0], inp.st_decode, pos)
        if inp.st_prefill is not None:
            rows = inp.sample_rows_p
            pos = (inp.start + inp.num_tokens)[rows]
            out[rows, 0] = sample(logits[nd * (1 + k):], inp.st_prefill, pos)
        return out
