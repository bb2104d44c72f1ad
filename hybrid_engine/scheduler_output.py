"""Typed hand-offs between the scheduler and the runner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request entering the batch (new, or resumed after preemption with a fresh slot)."""
    req_id: str
    epoch: int
    token_ids: tuple[int, ...]       # tokens to prefill: prompt + outputs committed so far
    slot: int                        # Mamba pool slot
    params: SamplingParams
    seed: int


class ScheduledRow(NamedTuple):
    """One request's part of a step (a NamedTuple: immutable and cheap to build, one per row per step)."""
    req_id: str
    epoch: int
    num_tokens: int                  # query length this step (decode rows: 1 + K)
    start_pos: int                   # prefill rows: exact; decode rows: an upper bound
    is_decode: bool                  # verify path: tokens come from last step's device outputs
    samples: bool                    # this step produces tokens for the request
    block_ids: tuple[int, ...]       # the request's whole block list (tables are rebuilt from it)


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int
    rows: tuple[ScheduledRow, ...]
    new_requests: tuple[NewRequestData, ...]
    removed_req_ids: frozenset[str]  # left the batch since the previous step
    num_spec: int                    # K: placeholder drafts per decode row

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Host copy of one step's results, in that step's row order."""
    step_id: int
    req_ids: tuple[str, ...]
    sampled: np.ndarray              # [B, 1+K] int64, -1 after the last valid token
    num_valid: np.ndarray            # [B] int64, valid tokens per row (0 for rows that sampled nothing)
    num_drafts: np.ndarray           # [B] int64, real drafts verified per row this step
    error: BaseException | None = None
