"""The n-gram drafter's whole greedy verify step as one CUDA graph replay (``spec_graphs.py``):
the proposal is the n-gram Triton kernel, which appends the step's tokens to the slots' histories
and drafts K for the next step. The pad rows' appends go to the null slot's history (never a
request's). Before a replay the drafter's pending slot resets are flushed (they are host writes
the graph then reads)."""
from __future__ import annotations

import logging

import torch

from .graphs import CudaGraphExecutor
from .spec_graphs import SpecStepGraphs, build_step_graphs

logger = logging.getLogger("hybrid_engine")


class NgramFollower:
    """The n-gram drafter inside a fused step's graph (the greedy step graphs' resting steps and
    ``NgramStepGraphs``' verify steps): its Triton kernel appends the step's tokens to the rows'
    histories and drafts K for the next step; pending slot resets are flushed before each replay."""

    def __init__(self, drafter):
        self.drafter, self.kernel, self.num_spec = drafter, drafter._kernel, drafter.num_spec

    def propose(self, slots, sampled, num_valid, next_start) -> torch.Tensor:
        return self.kernel(self.drafter._store, self.drafter.length, slots, sampled, num_valid, next_start)

    def before_replay(self) -> None:
        self.drafter.flush()


class NgramStepGraphs(SpecStepGraphs):
    name = "n-gram"
    # width 0 too: a step that verifies no drafts right after one that did (adaptive speculation
    # bringing every row to rest) is no greedy-graph step (its previous outputs have 1 + k columns),
    # so without it that step took the general path (3-8 steps of each bench-large run)
    verifies_no_drafts = True

    def __init__(self, executor: CudaGraphExecutor, drafter, *, num_spec: int, widths: tuple[int, ...],
                 block_size: int, max_blocks: int,
                 forced_acceptance_rate: float | None = None):
        kernel = getattr(drafter, "_kernel", None)
        if kernel is None:
            raise ValueError("n-gram step graphs need the n-gram drafter on its Triton kernel")
        super().__init__(executor, drafter, num_spec=num_spec, widths=widths, block_size=block_size,
                         max_blocks=max_blocks, forced_acceptance_rate=forced_acceptance_rate)
        self.follower = NgramFollower(drafter)             # the kernel call the greedy graphs capture too
        self._capture_all()

    def _propose(self, g, bucket: int, hidden, sampled, num_valid, next_start) -> torch.Tensor:
        return self.follower.propose(g.fb.mamba.decode_slots[:bucket], sampled, num_valid, next_start)  # [B, K]

    def _before_replay(self) -> None:
        self.follower.before_replay()                      # pending slot resets, before the graph reads them


def make_ngram_follower(drafter) -> NgramFollower | None:
    """The follower where the drafter runs its Triton kernel (else None: no greedy graphs)."""
    return None if getattr(drafter, "_kernel", None) is None else NgramFollower(drafter)


def make_ngram_graphs(executor, drafter, *, max_model_len: int = 0, **kw) -> NgramStepGraphs | None:
    """N-gram step graphs where they apply (CUDA graphs on, the n-gram drafter on Triton, the
    Triton input preparation); the choice is logged either way. (``max_model_len``: unused, the
    factories' common signature.)"""
    if getattr(drafter, "_kernel", None) is None:
        logger.info("n-gram step graphs: off (the n-gram drafter is not on its Triton kernel)")
        return None
    return build_step_graphs(NgramStepGraphs, "n-gram", executor, drafter, **kw)
