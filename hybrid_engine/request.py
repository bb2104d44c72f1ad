"""The small CPU-side Request: ids and counters only. Owned by the scheduler."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    num_steps: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)   # [K] accepted at draft position j

    num_tokens_out: int = 0
    num_preemptions: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens produced per decode/verify step: 1 + accepted drafts, averaged."""
        return (1 + self.drafts_accepted / self.num_steps) if self.num_steps else 0.0


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int                                  # resolved: params.seed or drawn at creation
    eos_token_ids: tuple[int, ...] = ()
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # Scheduling counters (properties below): held here while the request waits or after it
    # finished, and by the scheduler's RunningTable while it runs.
    _computed: int = field(default=0, repr=False)
    _prefill_target: int = field(default=0, repr=False)
    _inflight: int = field(default=0, repr=False)
    _table: object = field(default=None, repr=False, compare=False)   # RunningTable or None
    _trow: int = field(default=-1, repr=False, compare=False)         # row in _table
    epoch: int = 0                             # set by the scheduler (unique); new on preemption: older outputs are dropped
    slot: int | None = None                    # Mamba pool slot
    block_ids: list[int] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None                   # set when a step that carried it raised
    accounted: bool = False                    # counted in engine stats
    stop_ids: frozenset[int] | None = None     # stop tokens (+ EOS unless ignore_eos), built at first commit

    # num_computed_tokens is optimistic: it counts every token scheduled into the caches (drafts
    # included) and is corrected when the step's output arrives (an upper bound).
    @property
    def num_computed_tokens(self) -> int:
        t = self._table
        return self._computed if t is None else int(t.computed[self._trow])

    @num_computed_tokens.setter
    def num_computed_tokens(self, v: int) -> None:
        if self._table is None:
            self._computed = v
        else:
            self._table.computed[self._trow] = v

    @property
    def prefill_target(self) -> int:
        """Tokens to prefill since the last (re)start."""
        t = self._table
        return self._prefill_target if t is None else int(t.prefill_target[self._trow])

    @prefill_target.setter
    def prefill_target(self, v: int) -> None:
        if self._table is None:
            self._prefill_target = v
        else:
            self._table.prefill_target[self._trow] = v

    @property
    def num_inflight_steps(self) -> int:
        """Scheduled steps whose output is not processed yet."""
        t = self._table
        return self._inflight if t is None else int(t.inflight[self._trow])

    @num_inflight_steps.setter
    def num_inflight_steps(self, v: int) -> None:
        if self._table is None:
            self._inflight = v
        else:
            self._table.inflight[self._trow] = v

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
