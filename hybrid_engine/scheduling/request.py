"""The small CPU-side Request: ids and counters only. Owned by the scheduler."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..sampling_params import SamplingParams


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


class _Counter:
    """A scheduling counter of a Request: its own field (``field``) while it waits or after it
    finished, its RunningTable's column (``column``, row ``_trow``) while it runs.

    Ownership rule (docs/design.md "Who owns which counter"): at any moment exactly one of the
    two holds the value, chosen by ``req._table``; the other is stale and nothing reads it. The
    value moves only in ``RunningTable.add`` (copied in at admission or fork; ``_table`` set) and
    ``RunningTable.remove`` (copied out at preemption or finish; ``_table`` cleared). Every other
    reader and writer goes through this descriptor (or, for running rows only, the table's
    columns in the numpy steady paths: ``Scheduler._schedule_steady``, ``_update_steady``), so
    none can see the stale copy. The private
    fields ``_computed`` / ``_inflight`` / ``_prefill_target`` are touched by RunningTable alone.
    """

    def __init__(self, field: str, column: str):
        self.field, self.column = field, column

    def __get__(self, req, owner=None):
        if req is None:
            return self
        t = req._table
        return getattr(req, self.field) if t is None else int(getattr(t, self.column)[req._trow])

    def __set__(self, req, value: int) -> None:
        t = req._table
        if t is None:
            setattr(req, self.field, value)
        else:
            getattr(t, self.column)[req._trow] = value


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
    # Scheduling counters (the _Counter descriptors below): held here while the request waits (0 when
    # new or preempted) or after it finished (the table's last values), and by the scheduler's
    # RunningTable while it runs; read and written only by RunningTable.add / remove (see _Counter).
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
    stop_strings: object = None                # sampling.stop_strings.StopStrings when params.stop is set
    processing: object = None                  # sampling.logits_processing.ProcessingSpec, or None
    output_logprobs: list | None = None        # per output token {token id: logprob} (params.logprobs set)
    prompt_logprobs: list | None = None        # per prompt position, None at 0 (params.prompt_logprobs set)
    # n > 1 (scheduling/fork.py): the leader prefills the prompt but its last token, and its
    # siblings start from a copy of that state in the step that runs the leader's last token
    fork_pending: list | None = None           # leader: siblings not admitted yet
    fork_leader: object = None                 # sibling: its leader while it waits for the fork
    # prefix caching: hash chain of the full blocks of all_token_ids (scheduling/prefix_cache.py), and
    # the tokens restored from the cache at the latest admission
    block_hashes: list[bytes] = field(default_factory=list, repr=False, compare=False)
    num_cached_tokens: int = 0

    # num_computed_tokens is optimistic: it counts every token scheduled into the caches (drafts
    # included) and is corrected when the step's output arrives (an upper bound).
    num_computed_tokens = _Counter("_computed", "computed")
    prefill_target = _Counter("_prefill_target", "prefill_target")      # tokens to prefill since the last (re)start
    num_inflight_steps = _Counter("_inflight", "inflight")  # scheduled steps whose output is not processed yet

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
