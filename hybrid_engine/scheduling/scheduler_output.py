"""Typed hand-offs between the scheduler and the runner."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ..sampling_params import SamplingParams


class BlockTail:
    """The end of a block list whose first ``start`` ids the receiver already holds (a
    tensor-parallel worker's copy of a steady step): ``len`` is the whole list's, and slices from
    ``start`` on return its ids. ``InputBatch.set_blocks`` copies exactly such a slice (the ids past
    those it wrote); a slice reaching before ``start`` is an IndexError, never stale ids."""
    __slots__ = ("start", "ids")

    def __init__(self, start: int, ids: tuple[int, ...]):
        self.start, self.ids = start, ids

    def __len__(self) -> int:
        return self.start + len(self.ids)

    def __getitem__(self, key: slice) -> tuple[int, ...]:
        a, b, step = key.indices(len(self))
        if step != 1 or (a < self.start and b > a):
            raise IndexError(f"block ids [{a}:{b}] of a tail that starts at {self.start}")
        return self.ids[a - self.start:b - self.start]

    def __getstate__(self):
        return self.start, self.ids

    def __setstate__(self, state):
        self.start, self.ids = state


@dataclass(frozen=True)
class ForkSource:
    """A request of an ``n > 1`` group that starts from its leader's prefill: the runner copies the
    Mamba state of ``src_slot`` and the KV of ``src_blocks`` (the first ``num_tokens`` tokens) into
    the new request's slot and ``dst_blocks`` before the step's forward."""
    src_slot: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class NewRequestData:
    """A request entering the batch (new, or resumed after preemption with a fresh slot)."""
    req_id: str
    epoch: int
    token_ids: tuple[int, ...]       # tokens to prefill: prompt + outputs committed so far
    slot: int                        # Mamba pool slot
    params: SamplingParams
    seed: int
    num_prompt_tokens: int = 0       # token_ids[:num_prompt_tokens] is the prompt, the rest outputs
    processing: object = None        # sampling.logits_processing.ProcessingSpec, or None
    fork: ForkSource | None = None   # starts from its group leader's prefill (n > 1), else None


class ScheduledRow(NamedTuple):
    """One request's part of a step (a NamedTuple: immutable and cheap to build, one per row per step)."""
    req_id: str
    epoch: int
    num_tokens: int                  # query length this step (decode rows: 1 + K)
    start_pos: int                   # prefill rows: exact; decode rows: an upper bound
    is_decode: bool                  # verify path: tokens come from last step's device outputs
    samples: bool                    # this step produces tokens for the request
    block_ids: tuple[int, ...]       # the request's whole block list (tables are rebuilt from it)
    restore_row: int = -1            # prefix cache: Mamba checkpoint row restored into the slot before
                                     # this chunk (the first chunk after a hit), -1 none
    ckpt_saves: tuple[tuple[int, int], ...] = ()   # prefix cache: (boundary q, checkpoint row) this
                                     # chunk saves, q in (start_pos, start_pos + num_tokens]


@dataclass(frozen=True)
class DecodeRows:
    """The decode rows of a steady step, columnar (the scheduler's vectorised path): every row
    is a running request in decode, with 1 + K tokens, sampling. Consumers that need per-row
    objects read ``SchedulerOutput.rows``, which builds them from these columns."""
    req_ids: tuple[str, ...]         # the same tuple object while the batch composition holds
    epochs: np.ndarray               # [n] int64
    start_pos: np.ndarray            # [n] int64 upper bounds (as ScheduledRow.start_pos)
    num_tokens: int                  # 1 + K
    block_ids: tuple[list[int], ...] # each request's live block list (only grows while it runs); in a
                                     # tensor-parallel worker's copy of a steady step, a BlockTail for
                                     # rows in ``grown``, None for the others (SchedulerOutput.for_workers)
    grown: tuple[int, ...]           # rows (indices into req_ids) whose blocks grew this step
    table_rows: np.ndarray           # [n] int64 rows of the scheduler's RunningTable
    table_version: int               # RunningTable.version when scheduled (rows valid while equal)

    def __len__(self) -> int:
        return len(self.req_ids)

    def to_rows(self) -> tuple[ScheduledRow, ...]:
        n = self.num_tokens
        return tuple(ScheduledRow(rid, ep, n, st, True, True, tuple(b)) for rid, ep, st, b in
                     zip(self.req_ids, self.epochs.tolist(), self.start_pos.tolist(), self.block_ids))


@dataclass(frozen=True)
class SchedulerOutput:
    step_id: int
    other_rows: tuple[ScheduledRow, ...]   # every row when ``decode`` is None, else the rows after it
    new_requests: tuple[NewRequestData, ...]
    removed_req_ids: frozenset[str]  # left the batch since the previous step
    num_spec: int                    # K: placeholder drafts per decode row
    decode: DecodeRows | None = None # a steady step's decode rows (first in step order)

    def __getstate__(self):
        """Pickled (tensor-parallel step messages) without the cached ``rows``: they repeat
        ``decode``'s columns and are rebuilt on first use."""
        state = dict(self.__dict__)
        state.pop("rows", None)
        return state

    def for_workers(self, held_blocks=None) -> SchedulerOutput:
        """This step as the other tensor-parallel ranks need it. A steady step's runner reads only
        the block lists of the ``grown`` rows (``ModelRunner._update_batch``), so the others are
        sent as None: at 256 rows of 128k tokens the whole lists are ~2M ids (~10 MB pickled) per
        step. ``held_blocks(req_id)``: how many ids of a row's list the workers already hold
        (rank 0's own runner, before it applies this step: the ranks' batches are mirrors); a
        grown row is then sent as a ``BlockTail`` of the ids past those, usually one. Without it
        grown rows go whole. Other steps go whole."""
        d = self.decode
        if d is None or self.other_rows or self.new_requests or self.removed_req_ids:
            return self
        grown = set(d.grown)

        def sent(i: int, ids):
            if i not in grown:
                return None
            held = None if held_blocks is None else held_blocks(d.req_ids[i])
            if held is None or not 0 <= held <= len(ids):
                return ids
            return BlockTail(held, tuple(ids[held:]))
        blocks = tuple(sent(i, b) for i, b in enumerate(d.block_ids))
        return replace(self, decode=replace(d, block_ids=blocks))

    @cached_property
    def rows(self) -> tuple[ScheduledRow, ...]:
        """All rows of the step in scheduling order (built from ``decode`` on first use)."""
        if self.decode is None:
            return self.other_rows
        return self.decode.to_rows() + self.other_rows

    @property
    def num_tokens(self) -> int:
        if self.decode is None:
            return sum(r.num_tokens for r in self.other_rows)
        return len(self.decode) * self.decode.num_tokens + sum(r.num_tokens for r in self.other_rows)


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Host copy of one step's results, in that step's row order."""
    step_id: int
    req_ids: tuple[str, ...]
    sampled: np.ndarray              # [B, 1+K] int64, -1 after the last valid token
    num_valid: np.ndarray            # [B] int64, valid tokens per row (0 for rows that sampled nothing)
    num_drafts: np.ndarray           # [B] int64, real drafts verified per row this step
    error: BaseException | None = None
    nonfinite_rows: np.ndarray | None = None  # [n] int64 rows whose logits were not finite (None: none)
    logprobs: np.ndarray | None = None        # [B, 1+K, 1+2N] float64 (sampling/logprobs.py) or None
    prompt_logprobs: list | None = None       # [(PromptSpan, float64 [count, 1+2N])] (sampling/prompt_logprobs.py)
