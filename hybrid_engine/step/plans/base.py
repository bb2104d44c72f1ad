"""The plan hook and the runner state every plan shares."""
from __future__ import annotations

import torch

from ..input_batch import InputBatch
from ..step_constants import StepConstants, StepScratch
from ..step_io import PrevStep, StepInputs, StepRows
from ..transfer import H2D


class StepResources:
    """The runner's step-path state that plans read and write (one owner: the runner builds it)."""
    __slots__ = ("batch", "h2d", "consts", "scratch", "executor", "block_size", "num_spec", "device")

    def __init__(self, *, batch: InputBatch, h2d: H2D, consts: StepConstants, scratch: StepScratch, executor,
                 block_size: int, num_spec: int, device: torch.device):
        self.batch = batch              # persistent per-row arrays (batch-row space)
        self.h2d = h2d                  # the step's pinned staging ring
        self.consts = consts            # device tensors fixed by a row count
        self.scratch = scratch          # decode-only outputs only the next step reads
        self.executor = executor        # EagerExecutor or CudaGraphExecutor (the forward)
        self.block_size, self.num_spec, self.device = block_size, num_spec, device


class StepPlan:
    """One route through a step. ``fused`` plans run prepare + forward + sampling (and, in a spec
    engine, the drafter) in ``replay(step, prev, h2d, next_width)`` (-> a ``FusedSpecStep``:
    tokens, valid counts, next starts, drafts, batch rows, payload, width); the others ``prepare``
    a ``StepInputs`` and the runner runs the forward, the sampler and the drafter on it."""
    fused = False

    def applies(self, step: StepRows, prev: PrevStep | None) -> bool:
        raise NotImplementedError

    def prepare(self, step: StepRows, prev: PrevStep | None) -> StepInputs:
        raise NotImplementedError


def draft_width(prev: PrevStep | None, num_spec: int) -> int:
    """Drafts each decode row of this step verifies: the width the previous step proposed
    (``PrevStep.drafts`` [B, width], chosen by the runner's draft policy), 0 without speculation or
    without a previous step (then the step has no decode rows). A host-known shape: no sync."""
    if not num_spec or prev is None:
        return 0
    return prev.drafts.shape[1]


def require_prev(prev: PrevStep | None, prev_idx) -> None:
    """Decode rows read the previous step's outputs: a row without one is a bookkeeping bug."""
    if prev is None or (prev_idx < 0).any():
        raise RuntimeError("decode row without a previous step output (scheduler/runner out of sync)")


def cat_rows(dec: torch.Tensor | None, pre: torch.Tensor | None, num_decode: int, num_prefill: int) -> torch.Tensor:
    """Decode rows' part then prefill rows' part; no copy when one side is empty (host counts)."""
    if not num_prefill:
        return dec
    if not num_decode:
        return pre
    return torch.cat([dec, pre])
