"""Results handed to users."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None (still running)
    stop_reason: str | None = None     # the stop string that ended the request (finish_reason "stop")
    logprobs: list[dict[int, float]] | None = None   # per token: {sampled id: logprob, top ids...}


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token (None at 0); first output only
    num_cached_tokens: int = 0         # prompt tokens restored from the prefix cache (latest admission)
