"""Mixed plan: prefill chunks, alone or after decode/verify rows (any step the others leave)."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from ..forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
from ..prefill_staging import PrefillHost
from ..step_io import PrevStep, SpecInputs, StepInputs, StepRows
from .base import StepPlan, StepResources, cat_rows, draft_width, require_prev
from .staging import sampling_tensors, stage_sampling

# host arrays only a ForwardBatch reads: a step staged into a prefill graph's arena sends them there
_FORWARD_ONLY = ("ids_p", "pos_p", "slot_p", "qsl_p", "init_p", "seq_p", "logits_idx", "bt", "qsl")
_NO_SAVES = np.zeros(0, dtype=np.int64)


class MixedPlan(StepPlan):
    """Host arrays of the step -> one H2D copy (two for a step staged into a prefill graph's
    arena) -> the ForwardBatch. Decode rows' tokens, positions
    and accepted counts come from the previous step's device outputs; everything host-exact
    (prefill tokens and positions, query lengths, Mamba prefill metadata, sampling parameters) is
    staged, so the device only gathers and does no bookkeeping arithmetic the host can do."""

    def __init__(self, res: StepResources):
        self.res = res
        self._token_offsets = torch.arange(1 + res.num_spec, device=res.device)   # [1+K] offsets in a decode row

    def applies(self, step: StepRows, prev: PrevStep | None) -> bool:
        return True

    def prepare(self, step: StepRows, prev: PrevStep | None) -> StepInputs:
        res = self.res
        order = step.order
        res.h2d.begin_step()
        b, bs = res.batch, res.block_size
        k = draft_width(prev, res.num_spec)                      # this step's drafts per decode row
        tokens_per_row = 1 + k
        num_decode = sum(1 for r in order if r.is_decode)       # decode rows come first
        pre = order[num_decode:]
        num_prefill = len(pre)
        rows = np.fromiter((b.req_id_to_row[r.req_id] for r in order), dtype=np.int64, count=len(order))
        rows_p = rows[num_decode:]
        host: dict[str, np.ndarray] = {}
        # prefill rows: everything is exact on the host
        start_p = np.fromiter((r.start_pos for r in pre), dtype=np.int64, count=num_prefill)
        len_p = np.fromiter((r.num_tokens for r in pre), dtype=np.int64, count=num_prefill)
        samples_p = np.fromiter((r.samples for r in pre), dtype=bool, count=num_prefill)
        decode_tokens = num_decode * tokens_per_row
        qsl = np.concatenate([np.arange(num_decode + 1) * tokens_per_row, decode_tokens + np.cumsum(len_p)]
                             ).astype(np.int32)
        pos_p = np.concatenate([np.arange(a, a + n) for a, n in zip(start_p, len_p)]) if num_prefill else start_p
        row_of_tok = np.repeat(rows_p, len_p)
        host["ids_p"] = b.token_ids_cpu[row_of_tok, pos_p]
        host["pos_p"] = pos_p
        host["slot_p"] = b.block_table[row_of_tok, pos_p // bs].astype(np.int64) * bs + pos_p % bs
        host["start_p"] = start_p
        host["qsl_p"] = (qsl[num_decode:] - decode_tokens).astype(np.int64)   # Mamba: from the first prefill token
        host["init_p"] = start_p > 0                               # chunk continues an earlier chunk (or a restore)
        ckpt = _prefix_cache_arrays(pre, host["qsl_p"], b.slot[rows_p])
        host.update(ckpt)
        # the token after each input token: -1 on decode rows and where not known on the host
        host["next_ids"] = np.concatenate([np.full(decode_tokens, -1, np.int64),
                                           b.token_ids_cpu[row_of_tok, pos_p + 1]])
        sample_rows_p = num_decode + np.flatnonzero(samples_p)
        host["sample_rows_p"] = sample_rows_p
        host["sample_pos_p"] = (start_p + len_p)[samples_p]
        host["num_tokens"] = np.concatenate([np.full(num_decode, tokens_per_row, np.int64), len_p])
        host["qsl"] = qsl
        host["qsl64"] = qsl.astype(np.int64)                        # drafters index hidden with it
        host["is_decode"] = np.arange(num_decode + num_prefill) < num_decode
        if not num_decode:                                          # host-exact: no device ops for it
            host["seq_p"] = (start_p + len_p).astype(np.int32)
        host["logits_idx"] = np.concatenate([np.arange(decode_tokens),
                                             (qsl[num_decode + 1:] - 1)[samples_p]]).astype(np.int64)
        max_blocks = int(b.num_blocks[rows].max()) if len(rows) else 1
        host["bt"] = np.ascontiguousarray(b.block_table[rows, :max(max_blocks, 1)])
        host["slots"] = b.slot[rows]
        host["backup"] = b.backup_tokens(rows)
        if num_decode:
            prev_idx = b.prev_positions([r.req_id for r in order[:num_decode]])
            require_prev(prev, prev_idx)
            host["prev"] = prev_idx
            host["bt_d"] = host["bt"][:num_decode].astype(np.int64)   # gathered in int64: no device cast
            if prev.sampled.shape[1] == 1:
                # the previous step verified no drafts: every sampling row produced exactly one
                # token, so each decode row's Mamba accepted count is 1 and its input is column 0
                # of its previous sample (host-known)
                host["a_prev"] = np.ones(num_decode, dtype=np.int64)
        random_np = stage_sampling(b, host, rows)
        # a prefill-only step whose graph exists: its forward inputs go straight into the graph's
        # static arena (prefill_staging: no load_prefill copies before the replay)
        dest = (res.executor.prefill_dest(int(len_p[0]), restores=len(ckpt.get("restore_rows", ())),
                                          saves=len(ckpt.get("ckpt_rows", ())), logits=int(samples_p[0]))
                if not num_decode and num_prefill == 1 else None)
        if dest is not None:
            ph = PrefillHost(input_ids=host["ids_p"], positions=pos_p, slot_mapping=host["slot_p"],
                             block_table=host["bt"][0], seq_len=int(start_p[0] + len_p[0]), slot=int(host["slots"][0]),
                             has_initial_state=bool(start_p[0] > 0),
                             restore=((int(ckpt["restore_slots"][0]), int(ckpt["restore_rows"][0]))
                                      if "restore_rows" in ckpt else None),
                             ckpt_token=ckpt.get("ckpt_token", _NO_SAVES), ckpt_rows=ckpt.get("ckpt_rows", _NO_SAVES),
                             logits=bool(samples_p[0]))
            res.h2d.put_image(dest.arena, lambda image: dest.write(image, ph))
            for name in (*_FORWARD_ONLY, *ckpt):
                del host[name]
        staged = dict(zip(host, res.h2d.put(*host.values())))        # one H2D copy (a second: the arena's)
        if num_decode:
            ids_d, pos_d, slot_d, start_d, a_prev, drafts, draft_probs = self._decode_inputs(staged, prev, k)
        else:
            ids_d = pos_d = slot_d = start_d = None
            a_prev = res.consts.full(0, 0)                                    # [0] (cached: no op a step)
            drafts, draft_probs = res.consts.empty_rows(k), None               # [0, K]
        start = cat_rows(start_d, staged["start_p"], num_decode, num_prefill)
        num_tokens = staged["num_tokens"]
        if dest is not None:
            fb = dest.view(ph, decode_len=tokens_per_row, num_accepted=a_prev)
        else:
            fb = self._forward_batch(order, staged, ckpt, len_p, start, num_tokens, ids_d, pos_d, slot_d, a_prev,
                                     num_decode, num_prefill, tokens_per_row)
        sampling_all, sampling_decode, sampling_prefill = sampling_tensors(
            b, res.consts, staged, rows, num_decode, sample_rows_p, random_np)
        rows_sampling = np.concatenate([rows[:num_decode], rows_p[samples_p]])
        spec = (SpecInputs(drafts=drafts, draft_probs=draft_probs, sampling_all=sampling_all)
                if res.num_spec else None)                                   # a spec engine verifies, even 0 drafts
        return StepInputs(
            fb=fb, num_decode=num_decode, num_prefill=num_prefill, start=start, num_tokens=num_tokens,
            backup=staged["backup"], slots=staged["slots"], sample_rows_p=staged["sample_rows_p"],
            sample_pos_p=staged["sample_pos_p"], next_input_ids=staged["next_ids"], is_decode=staged["is_decode"],
            query_start_loc=staged["qsl64"], sampling_decode=sampling_decode, sampling_prefill=sampling_prefill,
            rows_sampling_np=rows_sampling, spec=spec)

    @staticmethod
    def _forward_batch(order, staged: dict[str, torch.Tensor], ckpt: dict, len_p: np.ndarray, start: torch.Tensor,
                       num_tokens: torch.Tensor, ids_d, pos_d, slot_d, a_prev: torch.Tensor, num_decode: int,
                       num_prefill: int, tokens_per_row: int) -> ForwardBatch:
        """The step's ForwardBatch from its staged arrays (decode rows' from the device gathers)."""
        seq_lens = (start + num_tokens).to(torch.int32) if num_decode else staged["seq_p"]
        max_seq = int(max([r.start_pos + r.num_tokens for r in order], default=1))
        return ForwardBatch(
            input_ids=cat_rows(ids_d, staged["ids_p"], num_decode, num_prefill),
            positions=cat_rows(pos_d, staged["pos_p"], num_decode, num_prefill),
            attn=AttnMetadata(query_start_loc=staged["qsl"], seq_lens=seq_lens, block_tables=staged["bt"],
                              slot_mapping=cat_rows(slot_d, staged["slot_p"], num_decode, num_prefill),
                              max_query_len=int(max([r.num_tokens for r in order], default=1)),
                              max_seq_len=max_seq),
            mamba=MambaMetadata(num_decode_rows=num_decode, decode_len=tokens_per_row,
                                decode_slots=staged["slots"][:num_decode], num_accepted=a_prev,
                                prefill_query_start_loc=staged["qsl_p"],
                                prefill_qsl_cpu=(0, *itertools.accumulate(len_p.tolist())),   # numpy: host
                                prefill_slots=staged["slots"][num_decode:], has_initial_state=staged["init_p"],
                                **{name: staged[name] for name in ckpt}),
            logits_indices=staged["logits_idx"])

    def _decode_inputs(self, staged: dict[str, torch.Tensor], prev: PrevStep, k: int):
        """Decode rows' inputs gathered from the previous step's outputs through staged["prev"]
        [N_d] -> (ids [N_d*(1+K)], positions [N_d*(1+K)], slot mapping [N_d*(1+K)], start [N_d],
        accepted [N_d], drafts [N_d, K], draft probs [N_d, K, V] or None)."""
        bs = self.res.block_size
        prev_idx = staged["prev"]
        if "a_prev" in staged:                                              # the previous step kept one token a row
            a_prev = staged["a_prev"]
            last = prev.sampled[prev_idx][:, :1]                             # [N_d, 1]
        else:
            a_prev = prev.num_valid[prev_idx].clamp(min=1)                   # Mamba accepted count (design invariant 7)
            last = prev.sampled[prev_idx].gather(1, (a_prev - 1)[:, None])   # [N_d, 1]
        if k:
            drafts = prev.drafts[prev_idx]
            draft_probs = prev.draft_probs[prev_idx] if prev.draft_probs is not None else None
            ids_d = torch.cat([last, drafts.clamp(min=0)], 1).reshape(-1)   # -1 never indexes the embedding
        else:
            drafts = prev.drafts[prev_idx] if self.res.num_spec else None   # [N_d, 0]
            draft_probs = None
            ids_d = last.reshape(-1)                                         # [N_d, 1] -> [N_d]
        start_d = prev.next_start[prev_idx]
        pos_d = start_d[:, None] + self._token_offsets[:1 + k]              # [N_d, 1+K]
        slot_d = (staged["bt_d"].gather(1, pos_d // bs) * bs + pos_d % bs).reshape(-1)
        return ids_d, pos_d.reshape(-1), slot_d, start_d, a_prev, drafts, draft_probs



def _prefix_cache_arrays(pre, qsl_p: np.ndarray, slots_p: np.ndarray) -> dict[str, np.ndarray]:
    """Prefix-cache metadata of the prefill rows (``MambaMetadata.restore_*`` / ``ckpt_*``), only
    the non-empty ones: which pool slots restore which checkpoint row before the forward
    (``slots_p`` [B_p]: the prefill rows' slots), and which (row, token, checkpoint row) states
    the chunk saves. Host-exact, staged with the step's one H2D copy."""
    out: dict[str, np.ndarray] = {}
    restore = [(slots_p[i], r.restore_row) for i, r in enumerate(pre) if r.restore_row >= 0]
    if restore:
        out["restore_slots"], out["restore_rows"] = (np.array(c, dtype=np.int64) for c in zip(*restore))
    saves = [(i, int(qsl_p[i]) + q - r.start_pos - 1, row) for i, r in enumerate(pre) for q, row in r.ckpt_saves]
    if saves:
        out["ckpt_seq"], out["ckpt_token"], out["ckpt_rows"] = (np.array(c, dtype=np.int64) for c in zip(*saves))
    return out
