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
general path's. It always drafts K (the runner keeps the width its policy picks). Pad rows (rows
>= N of the bucket) have the null Mamba slot and zeroed block tables from ``prepare_decode``; their
fork and single-token steps use the null slot, are invalid at position 0 and write their KV to the
null block.
"""
from __future__ import annotations

import logging

import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.spec.drafters.common import single_token_batch

from .graphs import CudaGraphExecutor
from .spec_graphs import SpecStepGraphs, build_step_graphs

logger = logging.getLogger("hybrid_engine")


class DraftModelStepGraphs(SpecStepGraphs):
    name = "draft-model"
    verifies_no_drafts = True    # the drafter follows every step (its caches)

    def __init__(self, executor: CudaGraphExecutor, drafter, *, num_spec: int, widths: tuple[int, ...],
                 block_size: int, max_blocks: int, max_model_len: int,
                 forced_acceptance_rate: float | None = None):
        super().__init__(executor, drafter, num_spec=num_spec, widths=widths, block_size=block_size,
                         max_blocks=max_blocks, forced_acceptance_rate=forced_acceptance_rate)
        # the length bound the draft's single-token step graphs were captured with (graphs.py)
        self.max_seq = max_model_len + 2
        self._capture_all()

    def _propose(self, g, bucket: int, hidden, sampled, num_valid, next_start) -> torch.Tensor:
        d = self.drafter
        fb = g.fb
        d.model(fb, d.caches)                                 # follow the target's step (logits unused)
        rows = torch.arange(bucket, device=num_valid.device)
        real = rows < self.staged[0]                          # pads: rows >= N (the staged header)
        valid = (num_valid > 0) & real
        slots = torch.where(real, fb.mamba.decode_slots[:bucket], NULL_SLOT)           # [B]
        scratch = torch.where(real, slots + d.max_num_seqs, NULL_SLOT)                # [B]
        d._fork(slots, scratch, num_valid.clamp(min=1))
        tok = sampled.gather(1, (num_valid - 1).clamp(min=0)[:, None]).squeeze(1)    # [B] newest sample
        pos = torch.where(real, next_start, 0)
        block_tables = fb.attn.block_tables[:bucket]
        drafts = []
        for _ in range(self.num_spec):
            sfb = single_token_batch(tok, pos, block_tables, self.block_size, scratch, valid, self.max_seq)
            h = d.model(sfb, d.caches)
            tok = d.model.compute_logits(h[sfb.logits_indices]).argmax(-1)
            pos = pos + 1
            drafts.append(tok)
        return torch.where(valid[:, None], torch.stack(drafts, 1), -1)                # [B, K]


def make_draft_model_step_graphs(executor, drafter, **kw) -> DraftModelStepGraphs | None:
    """Draft-model step graphs where they apply (CUDA graphs on, the Triton input preparation);
    the choice is logged either way."""
    return build_step_graphs(DraftModelStepGraphs, "draft-model", executor, drafter, **kw)
