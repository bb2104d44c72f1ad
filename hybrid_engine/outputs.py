"""Results handed to users."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None (still running)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    num_cached_tokens: int = 0         # prompt tokens restored from the prefix cache (latest admission)
