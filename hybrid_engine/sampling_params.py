"""User-facing sampling parameters, validated before anything is queued."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        self.validate()

    def validate(self) -> None:
        def bad(name, allowed):
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid: allowed {allowed}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not self.temperature >= 0:
            bad("temperature", ">= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            bad("top_k", "-1 (off) or an integer >= 1")
        if not 0 < self.top_p <= 1:
            bad("top_p", "a value in (0, 1]")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "a value in [0, 1]")
        if self.n != 1:
            bad("n", "1 (parallel sampling is not supported)")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", "None or an integer in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
