"""The draft model's whole greedy verify step as one CUDA graph replay (``spec_graphs.py``).

On the general path a draft-model step adds to the target's verify step the drafter's host work:
the replay of the target's forward batch on the draft's caches (copies into the draft's verify
graph, its replay), the fork of each row's state into its scratch slot, then K single-token steps,
each building its batch, copying it into the draft's step graph, replaying it and drawing. On the
trained default model (bf16, H200, 2026-11-26) that step cost 2.9 ms against 0.13 ms for a greedy
step, 2.7 ms of it host time. Here the proposal is captured after verification in the step's
graph:

    the draft model over the target's forward batch (its caches follow the step: the same
    tokens, positions, block ids, Mamba slots and accepted counts) -> each row's state after its
    last accepted token forked into its scratch slot -> K single-token steps from the newest
    sample at its position (next_start), each an argmax

the same ops, in the same order, as ``DraftModelDrafter.propose`` for greedy rows, with the
draft's single-token length bound of its step graphs (max_model_len + 2), so the drafts equal the
general path's. It drafts K (the runner keeps the width its policy picks; a resting step before
another only follows, ``_follow``: the draft model's caches alone, ``model.follow``). Pad rows (rows
>= N of the bucket) have the null Mamba slot and zeroed block tables from ``prepare_decode``; their
fork and single-token steps use the null slot, are invalid at position 0 and write their KV to the
null block.
"""
from __future__ import annotations

import logging

import torch

from hybrid_engine.mamba_cache import NULL_SLOT

from .graphs import CudaGraphExecutor
from .single_token_steps import SingleTokenSteps, single_token_meta
from .spec_graphs import SpecStepGraphs, build_step_graphs

logger = logging.getLogger("hybrid_engine")


class DraftModelStepGraphs(SpecStepGraphs):
    name = "draft-model"
    verifies_no_drafts = True    # the drafter follows every step (its caches)
    follows_without_drafting = True

    def __init__(self, executor: CudaGraphExecutor, drafter, *, num_spec: int, widths: tuple[int, ...],
                 block_size: int, max_blocks: int, max_model_len: int,
                 forced_acceptance_rate: float | None = None):
        super().__init__(executor, drafter, num_spec=num_spec, widths=widths, block_size=block_size,
                         max_blocks=max_blocks, forced_acceptance_rate=forced_acceptance_rate)
        # the length bound the draft's single-token step graphs were captured with (graphs.py)
        self.max_seq = max_model_len + 2
        self.single = SingleTokenSteps(self.max_rows, executor.device)
        self._capture_all()

    def _follow(self, g, bucket: int, hidden, sampled, num_valid, next_start) -> None:
        # the draft's caches follow the step and nothing else (model.follow: no fork, no
        # single-token steps, no layer after its last cache), as DraftModelDrafter.propose's eager
        # path for a next width 0
        self.drafter.model.follow(g.fb, self.drafter.caches)

    def _propose(self, g, bucket: int, hidden, sampled, num_valid, next_start) -> torch.Tensor:
        d = self.drafter
        fb = g.fb
        d.model(fb, d.caches)                                 # follow the target's step (logits unused)
        block_tables = fb.attn.block_tables[:bucket]
        # every single-token step's metadata at once: step j at next_start + j (pads, rows >= N
        # of the staged header, at j: invalid, so their KV goes to the null block)
        pos, slots, seq_lens, valid, newest = single_token_meta(
            next_start, num_valid, self.staged[:1], block_tables, steps=self.num_spec,
            block_size=self.block_size, tokens_per_row=sampled.shape[1], pads_advance=True)
        real = self.single.rows[:bucket] < self.staged[0]
        slots_m = torch.where(real, fb.mamba.decode_slots[:bucket], NULL_SLOT)          # [B]
        scratch = torch.where(real, slots_m + d.max_num_seqs, NULL_SLOT)              # [B]
        d._fork(slots_m, scratch, num_valid.clamp(min=1))
        tok = torch.take(sampled, newest)                                           # [B] newest sample
        drafts = []
        for j in range(self.num_spec):
            sfb = self.single.batch(tok, pos[j], seq_lens[j], slots[j], block_tables, scratch, self.max_seq)
            h = d.model(sfb, d.caches)
            tok = d.model.compute_logits(h[sfb.logits_indices]).argmax(-1)
            drafts.append(tok)
        return torch.where(valid[:, None], torch.stack(drafts, 1), -1)                # [B, K]


def make_draft_model_step_graphs(executor, drafter, **kw) -> DraftModelStepGraphs | None:
    """Draft-model step graphs where they apply (CUDA graphs on, the Triton input preparation);
    the choice is logged either way."""
    return build_step_graphs(DraftModelStepGraphs, "draft-model", executor, drafter, **kw)
