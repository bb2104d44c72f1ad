"""Model runner: update batch -> prepare inputs -> forward -> sample/verify -> propose -> D2H.

``execute`` launches one step's device work and returns a handle at once; the only wait is the
caller's, on the handle, one step later. Decode rows take their input tokens, positions and Mamba
accepted counts from the previous step's device outputs, gathered through ``prev_positions``.
"""
from __future__ import annotations

import numpy as np
import torch

from hybrid_engine.spec.drafters import DraftContext, Drafter
from hybrid_engine.spec.rejection import rejection_sample

from .decode_prep import DecodeDest, PrevOutputs, prepare_decode
from .forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
from .graphs import EagerExecutor
from .input_batch import InputBatch
from ..models.nemotron_h import Caches
from ..sampling.sampler import SamplingTensors, nonfinite_rows, sample
from ..scheduling.scheduler_output import ScheduledRow, SchedulerOutput
from .step_constants import StepConstants, StepScratch
from .step_io import PrevStep, StepHandle, StepInputs, mark_nonfinite
from .transfer import D2H, H2D


class ModelRunner:
    def __init__(self, model, caches: Caches, drafter: Drafter, *, max_num_seqs: int, max_model_len: int,
                 block_size: int, max_blocks: int, num_spec: int, device: torch.device):
        self.model, self.caches, self.drafter = model, caches, drafter
        self.executor = EagerExecutor(model, caches)     # replaced by a CudaGraphExecutor on CUDA
        self.device, self.block_size, self.num_spec = device, block_size, num_spec
        self.batch = InputBatch(max_num_seqs, max_model_len + 2 * (1 + num_spec), max_blocks)
        self.h2d = H2D(device)
        self.d2h = D2H(device)
        self.prev: PrevStep | None = None
        self._ar_s = torch.arange(1 + num_spec, device=device)          # [1+K] token offsets in a decode row
        self.consts = StepConstants(device, num_spec)                   # tensors fixed by a row count
        self.greedy_graphs = None       # a GreedyStepGraphs on CUDA with graphs on and K = 0 (engine)
        self.scratch = StepScratch(device)                              # decode-only step outputs

    # ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepHandle:
        d = sched.decode
        if d is not None and not (sched.other_rows or sched.new_requests or sched.removed_req_ids):
            # a steady decode step: no row joins or leaves, only grown block lists change
            b = self.batch
            for i in d.grown:
                b.set_blocks(b.req_id_to_row[d.req_ids[i]], d.block_ids[i])
            order, req_ids, decode_only = None, d.req_ids, True
        else:
            order = self._update_batch(sched)
            req_ids = tuple(r.req_id for r in order)
            decode_only = bool(order) and order[-1].is_decode      # decode rows come first
        try:
            fast = None if self.greedy_graphs is None or not decode_only else self.greedy_graphs.step(
                req_ids, self.batch, self.prev, self.h2d)
            if fast is not None:        # a greedy decode-only step, replayed as one graph
                sampled, next_start, rows, payload = fast     # payload: sampled with NONFINITE rows
                n = len(rows)
                handle = self._finish(sched, req_ids, rows, sampled, payload,
                                      PrevStep(sampled, self.consts.full(n, 1), next_start,
                                               self.consts.no_drafts(n), None))
                self.greedy_graphs.read_by(handle.copy_event)
                return handle
            if order is None:
                inp = self._prepare_decode_only(req_ids, int(d.start_pos.max()) + d.num_tokens)
            else:
                inp = self._prepare(order)
            hidden, logits = self.executor.forward(inp.fb)
            sampled = self._sample(logits, inp)
            nonfinite = self._nonfinite_step_rows(logits, inp)
        except BaseException:
            self.prev = None
            raise
        nd, npf = inp.num_decode, inp.num_prefill
        if inp.next_start is not None:
            # decode-only K = 0: every row yields exactly one token (invariant 7 holds by construction)
            num_valid, next_start = self.consts.full(nd, 1), inp.next_start
        else:
            num_valid = (sampled != -1).sum(1)                               # [B], invariant 7
            # decode rows advance by their valid tokens, prefill rows by their chunk
            next_start = inp.start + _cat_rows(num_valid[:nd] if npf else num_valid,
                                               inp.num_tokens[nd:] if nd else inp.num_tokens, nd, npf)
        ctx = self._draft_context(req_ids, inp, hidden, sampled, num_valid, next_start)
        drafts, draft_probs = self.drafter.propose(ctx)
        payload = mark_nonfinite(self._d2h_payload(sampled, inp), nonfinite)
        return self._finish(sched, req_ids, inp.rows_sampling_np, sampled, payload,
                            PrevStep(sampled, num_valid, next_start, drafts, draft_probs))

    def _finish(self, sched: SchedulerOutput, req_ids: tuple[str, ...], rows_sampling: np.ndarray,
                sampled: torch.Tensor, payload: torch.Tensor, prev: PrevStep) -> StepHandle:
        """The step's outputs become the next step's inputs; its payload goes to the host."""
        self.prev = prev
        self.batch.set_prev(req_ids)
        self.batch.append_placeholders(rows_sampling)
        return StepHandle(sched, req_ids, self.d2h.copy(payload), num_spec=self.num_spec)

    def _d2h_payload(self, sampled: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """[B, 1+K] sampled tokens, then (K > 0) the [B, K] drafts verified (-1 = none; prefill rows
        verified none): one tensor, one copy; the host derives num_valid and num_drafts from it."""
        if not self.num_spec:
            return sampled
        npf = inp.num_prefill
        drafts = inp.drafts
        if npf:
            drafts = torch.cat([drafts, torch.full((npf, self.num_spec), -1, dtype=torch.int64, device=self.device)])
        return torch.cat([sampled, drafts], 1)

    def _nonfinite_step_rows(self, logits: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """[B] bool: step rows with a non-finite logit row (a decode row: any of its 1+K rows).
        logits rows: N_d*(1+K) decode rows, then one per sampling prefill row. One reduction over
        the logits (small beside the lm_head that made them) and a few [B] ops; no sync."""
        bad = nonfinite_rows(logits)
        nd, npf, s = inp.num_decode, inp.num_prefill, 1 + self.num_spec
        dec = bad[:nd * s].view(nd, s).any(1)
        if not npf:
            return dec
        out = torch.zeros(nd + npf, dtype=torch.bool, device=self.device)
        out[:nd] = dec
        out[inp.sample_rows_p] = bad[nd * s:]
        return out

    def _draft_context(self, req_ids, inp: StepInputs, hidden, sampled, num_valid, next_start) -> DraftContext:
        """The drafter's view of this step. For drafters with ``full_context = False`` (n-gram, none)
        input_token and token_index stay None, which saves the device ops that derive them."""
        common = dict(req_ids=req_ids, slots=inp.slots, sampled=sampled, num_valid=num_valid, input_pos=next_start,
                      is_decode=inp.is_decode, query_start_loc=inp.query_start_loc,
                      hidden=hidden, input_ids=inp.fb.input_ids, positions=inp.fb.positions,
                      next_input_ids=inp.next_input_ids, forward_batch=inp.fb, sampling=inp.st_all,
                      block_size=self.block_size)
        if not self.drafter.full_context:
            return DraftContext(input_token=None, token_index=None, **common)
        n_dec = inp.num_decode
        last_idx = (num_valid - 1).clamp(min=0)
        last_tok = sampled.gather(1, last_idx[:, None]).squeeze(1)
        return DraftContext(
            input_token=last_tok if inp.backup is None else torch.where(num_valid > 0, last_tok, inp.backup),
            token_index=self._token_index(inp, last_idx, n_dec), **common)

    def _token_index(self, inp: StepInputs, last_idx: torch.Tensor, n_dec: int) -> torch.Tensor:
        """Index into hidden of the token whose logits produced each row's last valid sample."""
        qsl = inp.query_start_loc
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
        """Host arrays of the step -> one H2D copy -> the ForwardBatch. Decode rows' tokens, positions
        and accepted counts come from the previous step's device outputs; everything host-exact
        (prefill tokens and positions, query lengths, Mamba prefill metadata, sampling parameters) is
        staged, so the device only gathers and does no bookkeeping arithmetic the host can do."""
        self.h2d.begin_step()
        b, bs, k = self.batch, self.block_size, self.num_spec
        s = 1 + k
        nd = sum(1 for r in order if r.is_decode)
        if nd == len(order) and nd:
            return self._prepare_decode_only(tuple(r.req_id for r in order),
                                             max(r.start_pos + s for r in order))
        pre = order[nd:]
        npf = len(pre)
        rows = np.fromiter((b.req_id_to_row[r.req_id] for r in order), dtype=np.int64, count=len(order))
        rows_p = rows[nd:]
        host: dict[str, np.ndarray] = {}
        # prefill rows: everything is exact on the host
        start_p = np.fromiter((r.start_pos for r in pre), dtype=np.int64, count=npf)
        len_p = np.fromiter((r.num_tokens for r in pre), dtype=np.int64, count=npf)
        samples_p = np.fromiter((r.samples for r in pre), dtype=bool, count=npf)
        qsl = np.concatenate([np.arange(nd + 1) * s, nd * s + np.cumsum(len_p)]).astype(np.int32)
        pos_p = np.concatenate([np.arange(a, a + n) for a, n in zip(start_p, len_p)]) if npf else start_p
        row_of_tok = np.repeat(rows_p, len_p)
        host["ids_p"] = b.token_ids_cpu[row_of_tok, pos_p]
        host["pos_p"] = pos_p
        host["slot_p"] = b.block_table[row_of_tok, pos_p // bs].astype(np.int64) * bs + pos_p % bs
        host["start_p"] = start_p
        host["qsl_p"] = (qsl[nd:] - nd * s).astype(np.int64)      # Mamba: relative to the first prefill token
        host["init_p"] = start_p > 0                               # chunk continues an earlier chunk
        # the token after each input token: -1 on decode rows and where not known on the host
        host["next_ids"] = np.concatenate([np.full(nd * s, -1, np.int64), b.token_ids_cpu[row_of_tok, pos_p + 1]])
        sample_rows_p = nd + np.flatnonzero(samples_p)
        host["sample_rows_p"] = sample_rows_p
        host["sample_pos_p"] = (start_p + len_p)[samples_p]
        host["num_tokens"] = np.concatenate([np.full(nd, s, np.int64), len_p])
        host["qsl"] = qsl
        host["qsl64"] = qsl.astype(np.int64)                        # drafters index hidden with it
        host["is_decode"] = np.arange(nd + npf) < nd
        host["logits_idx"] = np.concatenate([np.arange(nd * s), (qsl[nd + 1:] - 1)[samples_p]]).astype(np.int64)
        max_blocks = int(b.num_blocks[rows].max()) if len(rows) else 1
        host["bt"] = np.ascontiguousarray(b.block_table[rows, :max(max_blocks, 1)])
        host["slots"] = b.slot[rows]
        host["backup"] = b.backup_tokens(rows)
        if nd:
            prev_idx = b.prev_positions([r.req_id for r in order[:nd]])
            if self.prev is None or (prev_idx < 0).any():
                raise RuntimeError("decode row without a previous step output (scheduler/runner out of sync)")
            host["prev"] = prev_idx
            host["bt_d"] = host["bt"][:nd].astype(np.int64)        # gathered in int64: no device cast
            if not k:
                # K = 0: every sampling row produced exactly one token, so each decode row's Mamba
                # accepted count is 1 and its input is column 0 of its previous sample (host-known)
                host["a_prev"] = np.ones(nd, dtype=np.int64)
        random_np = self._stage_sampling(host, rows)
        t = dict(zip(host, self.h2d.put(*host.values())))                     # the step's one H2D copy
        dev = self.device
        if nd:
            ids_d, pos_d, slot_d, start_d, a_prev, drafts, draft_probs = self._decode_inputs(t)
        else:
            a_prev = torch.zeros(0, dtype=torch.int64, device=dev)
            drafts, draft_probs = torch.empty(0, k, dtype=torch.int64, device=dev), None
        start = _cat_rows(start_d if nd else None, t["start_p"], nd, npf)
        num_tokens = t["num_tokens"]
        seq_lens = (start + num_tokens).to(torch.int32)
        max_seq = int(max([r.start_pos + r.num_tokens for r in order], default=1))
        fb = ForwardBatch(
            input_ids=_cat_rows(ids_d if nd else None, t["ids_p"], nd, npf),
            positions=_cat_rows(pos_d if nd else None, t["pos_p"], nd, npf),
            attn=AttnMetadata(t["qsl"], seq_lens, t["bt"], _cat_rows(slot_d if nd else None, t["slot_p"], nd, npf),
                              max_query_len=int(max([r.num_tokens for r in order], default=1)),
                              max_seq_len=max_seq),
            mamba=MambaMetadata(nd, s, t["slots"][:nd], a_prev, t["qsl_p"],
                                tuple(int(x) for x in np.concatenate([[0], np.cumsum(len_p)])),
                                t["slots"][nd:], t["init_p"]),
            logits_indices=t["logits_idx"])
        st_all, st_decode, st_prefill = self._sampling(t, rows, nd, sample_rows_p, random_np)
        rows_sampling = np.concatenate([rows[:nd], rows_p[samples_p]])
        return StepInputs(fb, nd, npf, start, num_tokens, drafts, draft_probs, t["backup"], t["slots"],
                          t["sample_rows_p"], t["sample_pos_p"], t["next_ids"], t["is_decode"], t["qsl64"], st_decode, st_prefill,
                          st_all if k else None, rows_sampling)

    def _prepare_decode_only(self, req_ids: tuple[str, ...], max_seq: int) -> StepInputs:
        """A step of decode/verify rows only (``req_ids`` in step order; ``max_seq`` bounds every
        row's sequence length): one staged array (prev index, slot, block-table rows) and one
        ``prepare_decode`` launch that writes every input, straight into a CUDA graph bucket's
        buffers when the executor has one. The other per-step tensors of such a step are
        constants of the row count, built once."""
        b, k = self.batch, self.num_spec
        s, n = 1 + k, len(req_ids)
        rows = b.rows_of(req_ids)
        prev_idx = b.prev_positions(req_ids)
        if self.prev is None or (prev_idx < 0).any():
            raise RuntimeError("decode row without a previous step output (scheduler/runner out of sync)")
        host, width = b.stage_decode(rows, prev_idx)
        random_np = b.temperature[rows] > 0
        t = None
        if random_np.any():
            t = dict(zip(("temp", "top_k", "top_p", "min_p", "seed"), self.h2d.put(
                b.temperature[rows], b.top_k[rows], b.top_p[rows], b.min_p[rows], b.seed[rows])))
            t["sample_rows_p"] = self.consts.empty_i64
        staged = self.h2d.put_raw(host)
        dev = self.device
        got = self.executor.decode_dest(n)
        if got is None:
            fb, dest = self._fresh_decode_batch(n, width, max_seq)
        else:
            dest, fb = got
        p = self.prev
        self.scratch.next_step()
        start = self.scratch.i64("start", n)
        drafts = torch.empty(n, k, dtype=torch.int64, device=dev) if k else self.consts.no_drafts(n)
        next_start = None if k else self.scratch.i64("next_start", n)
        prepare_decode(staged, n, width, PrevOutputs(p.sampled, p.num_valid, p.next_start, p.drafts), dest,
                       block_size=self.block_size, num_spec=k, start_out=start,
                       drafts_out=drafts if k else None, next_start_out=next_start)
        draft_probs = p.draft_probs[staged[:n]] if (k and p.draft_probs is not None) else None
        if t is None:
            st = self.consts.greedy_sampling(n)
            st_all = st_decode = st
        else:
            st_all, st_decode, _ = self._sampling(t, rows, n, np.zeros(0, np.int64), random_np)
        num_tokens = self.consts.full(n, s)
        return StepInputs(fb, n, 0, start, num_tokens, drafts, draft_probs, None, fb.mamba.decode_slots,
                          self.consts.empty_i64, self.consts.empty_i64, self.consts.full(n * s, -1), self.consts.full(n, 1, torch.bool),
                          self.consts.qsl64(n), st_decode, None, st_all if k else None, rows, next_start)

    def _fresh_decode_batch(self, n: int, width: int, max_seq: int) -> tuple[ForwardBatch, DecodeDest]:
        """Eager executor: new buffers for a decode-only batch (R = N rows, width W)."""
        s, dev = 1 + self.num_spec, self.device
        e64 = lambda m: torch.empty(m, dtype=torch.int64, device=dev)  # noqa: E731
        dest = DecodeDest(e64(n * s), e64(n * s), e64(n * s), torch.empty(n, dtype=torch.int32, device=dev),
                          torch.empty(n, width, dtype=torch.int32, device=dev), e64(n), e64(n))
        fb = ForwardBatch(dest.input_ids, dest.positions,
                          AttnMetadata(self.consts.qsl32(n), dest.seq_lens, dest.block_tables, dest.slot_mapping,
                                       max_query_len=s, max_seq_len=max_seq),
                          MambaMetadata(n, s, dest.decode_slots, dest.num_accepted, self.consts.zero_i64_1, (0,),
                                        self.consts.empty_i64, self.consts.empty_bool),
                          logits_indices=self.consts.arange(n * s))
        return fb, dest

    def _decode_inputs(self, t: dict[str, torch.Tensor]):
        """Decode rows' inputs gathered from the previous step's outputs through t["prev"] [N_d]
        -> (ids [N_d*s], positions [N_d*s], slot mapping [N_d*s], start [N_d], accepted [N_d],
        drafts [N_d, K], draft probs [N_d, K, V] or None)."""
        p, k, bs = self.prev, self.num_spec, self.block_size
        prev_t = t["prev"]
        nd = prev_t.shape[0]
        if k:
            a_prev = p.num_valid[prev_t].clamp(min=1)                      # Mamba accepted count
            last = p.sampled[prev_t].gather(1, (a_prev - 1)[:, None])      # [nd, 1]
            drafts = p.drafts[prev_t]
            draft_probs = p.draft_probs[prev_t] if p.draft_probs is not None else None
            ids_d = torch.cat([last, drafts.clamp(min=0)], 1).reshape(-1)
        else:
            a_prev = t["a_prev"]
            drafts, draft_probs = torch.empty(nd, 0, dtype=torch.int64, device=self.device), None
            ids_d = p.sampled[prev_t].reshape(-1)                          # [nd, 1] -> [nd]
        start_d = p.next_start[prev_t]
        pos_d = start_d[:, None] + self._ar_s                              # [nd, s]
        slot_d = (t["bt_d"].gather(1, pos_d // bs) * bs + pos_d % bs).reshape(-1)
        return ids_d, pos_d.reshape(-1), slot_d, start_d, a_prev, drafts, draft_probs

    def _stage_sampling(self, host: dict[str, np.ndarray], rows: np.ndarray) -> np.ndarray:
        """Add the step rows' sampling parameters to the step's staging when any row samples at
        random; returns the host flags ``temperature > 0`` per step row."""
        b = self.batch
        temp = b.temperature[rows]
        random_np = temp > 0
        if random_np.any():
            host.update(temp=temp, top_k=b.top_k[rows], top_p=b.top_p[rows], min_p=b.min_p[rows], seed=b.seed[rows])
        return random_np

    def _sampling(self, t: dict[str, torch.Tensor], rows: np.ndarray, nd: int, sample_rows_p: np.ndarray,
                  random_np: np.ndarray):
        """Sampling parameters -> (all rows, decode rows [:nd], sampling prefill rows); the subsets
        are device slices/gathers of the one staged copy, their host flags from numpy. A step whose
        rows are all greedy stages nothing: it gets cached all-greedy tensors (never read by the
        sampler's argmax path, but shaped like real ones for drafters)."""
        if not random_np.any():
            g = self.consts.greedy_sampling
            return (g(len(rows)), g(nd) if nd else None, g(len(sample_rows_p)) if len(sample_rows_p) else None)
        b = self.batch
        filt = ((b.top_k[rows] > 0) | (b.top_p[rows] < 1) | (b.min_p[rows] > 0)) & random_np
        dev = (t["temp"], t["top_k"], t["top_p"], t["min_p"], t["seed"])

        def subset(host_sel, dev_sel) -> SamplingTensors | None:
            if not random_np[host_sel].size:
                return None
            tt, tk, tp, mp, sd = (x[dev_sel] for x in dev)
            return SamplingTensors(temperature=tt, top_k=tk, top_p=tp, min_p=mp, seed=sd,
                                   all_greedy=not random_np[host_sel].any(), any_filter=bool(filt[host_sel].any()))
        return (subset(slice(None), slice(None)), subset(slice(0, nd), slice(0, nd)),
                subset(sample_rows_p, t["sample_rows_p"]))

    def _sample(self, logits: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """sampled [B, 1+K] int64: decode rows verified/sampled, sampling prefill rows in column 0,
        -1 elsewhere. A decode-only step returns the decode result itself (no -1 rows to fill)."""
        k = self.num_spec
        nd, npf = inp.num_decode, inp.num_prefill
        dec = None
        if nd:
            # position of the first produced token (the noise key; greedy rows never read it)
            pos = None if inp.st_decode.all_greedy else (inp.start[:nd] if npf else inp.start) + 1
            if k:
                ld = logits[:nd * (1 + k)].view(nd, 1 + k, -1)
                dec = rejection_sample(ld, inp.drafts, inp.draft_probs, inp.st_decode, pos)
            elif pos is None and not npf:       # all greedy, decode only: one op
                return logits.argmax(-1, keepdim=True)
            else:
                dec = sample(logits[:nd] if npf else logits, inp.st_decode, pos)[:, None]
            if not npf:
                return dec
        out = torch.full((nd + npf, 1 + k), -1, dtype=torch.int64, device=self.device)
        if nd:
            out[:nd] = dec
        if inp.st_prefill is not None:
            out[inp.sample_rows_p, 0] = sample(logits[nd * (1 + k):], inp.st_prefill, inp.sample_pos_p)
        return out


def _cat_rows(dec: torch.Tensor | None, pre: torch.Tensor | None, nd: int, npf: int) -> torch.Tensor:
    """Decode rows' part then prefill rows' part; no copy when one side is empty (host counts)."""
    if not npf:
        return dec
    if not nd:
        return pre
    return torch.cat([dec, pre])
