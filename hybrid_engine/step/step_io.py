"""Typed hand-offs of the model runner: the rows a step runs (``StepRows``), the previous step's
device outputs (``PrevStep``), one step's prepared inputs (``StepInputs``, with the speculative part
``SpecInputs``) and the handle a launched step is read through (``StepHandle``)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .forward_batch import ForwardBatch
from ..sampling.logprobs import unpack as unpack_logprobs
from ..sampling.sampler import SamplingTensors
from ..scheduling.scheduler_output import DecodeRows, ModelRunnerOutput, ScheduledRow, SchedulerOutput
from .transfer import D2HCopy

# A step row whose logits were not finite carries this value in its D2H payload (never a token, and
# distinct from the -1 "no token" pad); the device-side sampled tokens stay valid ids.
NONFINITE = -2


def mark_nonfinite(payload: torch.Tensor, bad_rows: torch.Tensor) -> torch.Tensor:
    """payload[B, C] with the rows flagged in bad_rows[B] (bool) set to NONFINITE: one device op,
    no sync; a new tensor, so the step's sampled tokens (the next step's inputs) are untouched."""
    return payload.masked_fill(bad_rows[:, None], NONFINITE)


@dataclass(frozen=True)
class PrevStep:
    """Device outputs of the previous step, in its step-row space (read only via prev_positions)."""
    sampled: torch.Tensor        # [B, 1+K] int64, -1 after the last valid token
    num_valid: torch.Tensor      # [B] int64 valid tokens per row (0: the row sampled nothing)
    next_start: torch.Tensor     # [B] int64 exact position of each row's next input token
    drafts: torch.Tensor         # [B, K] int64 drafts proposed for the next step, -1 = no draft
    draft_probs: torch.Tensor | None  # [B, K, V] float32 draft distributions (probabilistic drafters)


class StepRows:
    """Which rows one step runs, in step-row order (decode/verify rows first, then prefill chunks).
    Built by the runner's batch update, read by the plan choice and the plans."""
    __slots__ = ("req_ids", "order", "decode_only", "steady")

    def __init__(self, *, req_ids: tuple[str, ...], order: list[ScheduledRow] | None, decode_only: bool,
                 steady: DecodeRows | None):
        self.req_ids = req_ids          # [B] request ids in step-row order
        self.order = order              # per-row objects; None on a steady step (columns in ``steady``)
        self.decode_only = decode_only  # every row decodes/verifies (no prefill chunk)
        self.steady = steady            # a steady step's decode columns (nobody joined or left), else None


@dataclass(frozen=True)
class SpecInputs:
    """What a verify step checks: the drafts its decode rows carry. None when K = 0."""
    drafts: torch.Tensor                  # [N_d, K] int64 drafts verified this step (-1 = none)
    draft_probs: torch.Tensor | None      # [N_d, K, V] float32 (probabilistic drafters), else None
    sampling_all: SamplingTensors         # every step row's parameters (drafters sample with them)


@dataclass(frozen=True)
class StepInputs:
    """One step's prepared inputs (built by a plan, keyword arguments only). B = step rows,
    N_d = decode/verify rows (first), T = tokens, R_p = prefill rows that sample."""
    fb: ForwardBatch
    num_decode: int              # N_d
    num_prefill: int             # B - N_d
    start: torch.Tensor          # [B] int64 exact start position per step row
    num_tokens: torch.Tensor     # [B] int64 query length per step row
    backup: torch.Tensor | None  # [B] int64 backup token per row (None: decode-only, never read)
    slots: torch.Tensor          # [B] int64 Mamba/drafter slot per step row
    sample_rows_p: torch.Tensor  # [R_p] int64 step rows of prefill rows that sample
    sample_pos_p: torch.Tensor   # [R_p] int64 position of the token each of them samples
    next_input_ids: torch.Tensor # [T] int64 token after each input token where the host knows it, else -1
    is_decode: torch.Tensor      # [B] bool step row is a decode/verify row
    query_start_loc: torch.Tensor  # [B+1] int64 token offsets of the step rows
    sampling_decode: SamplingTensors | None   # decode rows' parameters ([N_d]), None without decode rows
    sampling_prefill: SamplingTensors | None  # [R_p] sampling prefill rows' parameters, None without
    rows_sampling_np: np.ndarray # [R] batch rows of the step rows that sample (host)
    spec: SpecInputs | None      # the verified drafts; None when K = 0
    next_start: torch.Tensor | None = None  # [B] known before sampling (decode-only, K = 0), else None


class StepHandle:
    def __init__(self, sched: SchedulerOutput, req_ids: tuple[str, ...], copy: D2HCopy | None,
                 error: BaseException | None = None, num_spec: int = 0, observe=None):
        """``num_spec``: the drafts each decode row of this step verified (its width);
        ``observe``: (draft policy, its snapshot of the step's rows), told the step's counts once
        they are on the host (adaptive speculation), or None."""
        self.sched, self.req_ids, self._copy, self.error = sched, req_ids, copy, error
        self.num_spec = num_spec
        self._observe = observe
        self.prompt_logprobs = None     # sampling.prompt_logprobs.PromptLogprobsCopy of this step, if any

    @property
    def copy_event(self) -> torch.cuda.Event | None:
        """The event after the D2H copy of this step's payload (None on CPU or without a copy)."""
        return None if self._copy is None else self._copy.event

    def _output(self, host: np.ndarray) -> ModelRunnerOutput:
        """Unpack the one D2H tensor ``[B, 1+K (+K drafts)]``; counts are derived on the host with
        the device's own rule (docs/design.md invariant 7: num_valid = tokens != -1), so only one copy
        travels. A row whose logits were not finite carries NONFINITE in column 0."""
        tokens_per_row = 1 + self.num_spec
        sampled = host[:, :tokens_per_row]                                  # [B, 1+K]
        bad = sampled[:, 0] == NONFINITE            # [B]: one compare per row; normally all False
        nonfinite = np.flatnonzero(bad) if bad.any() else None
        num_valid = (sampled != -1).sum(1, dtype=np.int64)
        if self.num_spec:
            num_drafts = (host[:, tokens_per_row:tokens_per_row + self.num_spec] != -1).sum(1, dtype=np.int64)
        else:
            num_drafts = np.zeros(len(host), dtype=np.int64)
        if self._observe is not None:
            policy, snapshot = self._observe
            self._observe = None                     # a handle read twice counts once
            policy.observe(snapshot, num_valid)
        base = tokens_per_row + self.num_spec          # then, when a row asked, the logprobs block
        logprobs = unpack_logprobs(host[:, base:], tokens_per_row) if host.shape[1] > base else None
        return ModelRunnerOutput(step_id=self.sched.step_id, req_ids=self.req_ids, sampled=sampled,
                                 num_valid=num_valid, num_drafts=num_drafts, nonfinite_rows=nonfinite,
                                 logprobs=logprobs,
                                 prompt_logprobs=None if self.prompt_logprobs is None else self.prompt_logprobs.read())

    def result(self) -> ModelRunnerOutput:
        return self._output(self._copy.wait())

    async def result_async(self) -> ModelRunnerOutput:
        return self._output(await self._copy.wait_async())
