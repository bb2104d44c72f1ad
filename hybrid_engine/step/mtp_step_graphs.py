"""The MTP drafter's whole greedy verify step as one CUDA graph replay (``spec_graphs.py``).

On the general path an MTP step adds to the target's verify step the drafter's own host work:
the shifted tokens and newest-sample indices, copies into the MTP verify graph's buffers and its
replay, then K-1 single-token steps, each with its copies, its replay and a greedy draw. On the
trained 5 M default model a K = 3 MTP step cost ~3 ms against ~0.4 ms for a greedy step (H100,
2026-11-24): host-bound. Here the proposal is captured after verification in the step's graph:

    the MTP layers over the step's tokens, each paired with the next token (this step's samples;
    placeholders -1 clamped to 0 as on the general path) and the target's hidden state, on the
    target's forward batch (its attention metadata: the MTP KV follows every computed position)
    -> hidden state and logits at each row's newest sample -> draft 1 = argmax -> for drafts
    2..K, one token per row: the previous draft and MTP hidden state at position
    next_start + j - 1 -> argmax

the same ops, in the same order, as ``MTPDrafter.propose`` for greedy decode rows, so the drafts
(and with them the tokens, which greedy verification makes independent of the drafts anyway)
equal the general path's. It drafts K (a resting step before another only follows: ``_follow``,
the MTP KV alone, ``MTP.follow``): the runner keeps the width its policy picks, and
MTP KV written for drafts that are not verified is rewritten by the next verify pass before any
step reads it (as for rejected drafts). Pad rows (rows >= N of the bucket) have zeroed block
tables and slot mappings, and their single-token steps are invalid at position 0: their MTP KV
goes to the null block and they add nothing to the MoE load counters.
"""
from __future__ import annotations

import logging
from dataclasses import replace

import torch

from .graphs import CudaGraphExecutor
from .single_token_steps import SingleTokenSteps, single_token_meta
from .spec_graphs import SpecStepGraphs, build_step_graphs

logger = logging.getLogger("hybrid_engine")


class MTPStepGraphs(SpecStepGraphs):
    name = "MTP"
    verifies_no_drafts = True    # the drafter follows every step (its caches)
    follows_without_drafting = True

    def __init__(self, executor: CudaGraphExecutor, drafter, *, num_spec: int, widths: tuple[int, ...],
                 block_size: int, max_blocks: int, max_model_len: int,
                 forced_acceptance_rate: float | None = None):
        super().__init__(executor, drafter, num_spec=num_spec, widths=widths, block_size=block_size,
                         max_blocks=max_blocks, forced_acceptance_rate=forced_acceptance_rate)
        # host bound of every row's length in a single-token step (as MTPGraphs)
        self.max_seq = max_model_len + 2 * (1 + num_spec) + 1
        self.single = SingleTokenSteps(self.max_rows, executor.device)
        self._capture_all()

    def _follow(self, g, bucket: int, hidden, sampled, num_valid, next_start) -> None:
        # the MTP KV of the step's tokens alone (MTP.follow: _propose's first pass up to the last
        # attention layer's k and v), as MTPDrafter.propose's eager path for a next width 0; with
        # _propose's length bound (an attention layer before the last one runs in full and splits
        # by it, so its outputs round as in a drafting step)
        fb = replace(g.fb, attn=replace(g.fb.attn, max_seq_len=self.max_seq))
        self.drafter.follow(sampled.reshape(-1).clamp(min=0), hidden[:bucket * sampled.shape[1]], fb)

    def _propose(self, g, bucket: int, hidden, sampled, num_valid, next_start) -> torch.Tensor:
        d = self.drafter
        # the verify pass reads the target's batch with the MTP graphs' length bound: the
        # attention's split count follows it, so the drafts round as on the general path
        fb = replace(g.fb, attn=replace(g.fb.attn, max_seq_len=self.max_seq))
        tokens_per_row = sampled.shape[1]
        shifted = sampled.reshape(-1).clamp(min=0)                            # [B * tokens_per_row]
        block_tables = fb.attn.block_tables[:bucket]
        # every single-token step's metadata at once. Step j (drafts 2..K) pairs index
        # next_start + j: the previous MTP hidden stands in for the target's. Pad rows (>= N, the
        # staged header) stay at position 0 and write nothing (slot 0 of the null block), as the
        # MTP graphs' pads: their next_start is a stale buffer value
        pos, slots, seq_lens, valid, idx = single_token_meta(
            next_start, num_valid, self.staged[:1], block_tables, steps=self.num_spec - 1,
            block_size=self.block_size, tokens_per_row=tokens_per_row, pads_advance=False)
        # [B, D] at each newest sample (the MTP KV of every token)
        mtp_hidden, normed = d._step(shifted, hidden[:bucket * tokens_per_row], fb, idx)
        tok = d.draft_argmax(normed)                                          # [B] draft 1
        drafts = [tok]
        for j in range(self.num_spec - 1):
            sfb = self.single.batch(tok, pos[j], seq_lens[j], slots[j], block_tables, None, self.max_seq)
            mtp_hidden, normed = d._step(tok, mtp_hidden, sfb)
            tok = d.draft_argmax(normed)
            drafts.append(tok)
        return torch.where(valid[:, None], torch.stack(drafts, 1), -1)        # [B, K]


def make_mtp_step_graphs(executor, drafter, **kw) -> MTPStepGraphs | None:
    """MTP step graphs where they apply (CUDA graphs on, the Triton input preparation); the
    choice is logged either way."""
    return build_step_graphs(MTPStepGraphs, "MTP", executor, drafter, **kw)
