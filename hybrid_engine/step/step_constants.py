"""Device tensors that depend only on a step's row count, built once per count.

Decode-only steps read several tensors whose values follow from the number of rows alone (query
offsets, logits indices, all-greedy sampling parameters, "every row yields one token"). Building
them every step costs a torch op (and host time) each; these are made on first use and reused.
Nothing may write into them: consumers that need to modify one clone it first.
"""
from __future__ import annotations

import torch

from ..sampling.sampler import SamplingTensors


class StepConstants:
    def __init__(self, device: torch.device, num_spec: int):
        self.device, self.tokens_per_row = device, 1 + num_spec        # the widest decode row
        self._cache: dict[tuple, object] = {}
        self.empty_i64 = torch.zeros(0, dtype=torch.int64, device=device)    # [0]
        self.empty_bool = torch.zeros(0, dtype=torch.bool, device=device)    # [0]
        self.zero_i64_1 = torch.zeros(1, dtype=torch.int64, device=device)   # [1]

    def _get(self, key, make):
        v = self._cache.get(key)
        if v is None:
            v = self._cache[key] = make()
        return v

    def full(self, n: int, value: int, dtype=torch.int64) -> torch.Tensor:
        """[n] filled with value."""
        return self._get(("full", n, value, dtype), lambda: torch.full((n,), value, dtype=dtype, device=self.device))

    def arange(self, n: int) -> torch.Tensor:
        """[n] int64 0..n-1."""
        return self._get(("arange", n), lambda: torch.arange(n, device=self.device))

    def qsl64(self, n: int, tokens_per_row: int | None = None) -> torch.Tensor:
        """[n+1] int64 token offsets of n rows of ``tokens_per_row`` tokens (default 1+K; adaptive
        steps verify fewer)."""
        w = self.tokens_per_row if tokens_per_row is None else tokens_per_row
        return self._get(("qsl64", n, w), lambda: torch.arange(n + 1, device=self.device) * w)

    def qsl32(self, n: int, tokens_per_row: int | None = None) -> torch.Tensor:
        """[n+1] int32, the same offsets (attention metadata)."""
        w = self.tokens_per_row if tokens_per_row is None else tokens_per_row
        return self._get(("qsl32", n, w), lambda: self.qsl64(n, w).to(torch.int32))

    def empty_rows(self, k: int) -> torch.Tensor:
        """[0, k] int64 (no rows of k columns)."""
        return self._get(("emptyrows", k), lambda: torch.empty(0, k, dtype=torch.int64, device=self.device))

    def no_drafts(self, n: int) -> torch.Tensor:
        """[n, 0] int64."""
        return self._get(("nodrafts", n), lambda: torch.empty(n, 0, dtype=torch.int64, device=self.device))

    def greedy_sampling(self, n: int) -> SamplingTensors:
        """Parameters of n greedy rows (temperature 0, filters off, seed 0)."""
        dev = self.device
        return self._get(("greedy", n), lambda: SamplingTensors(
            temperature=torch.zeros(n, dtype=torch.float32, device=dev),
            top_k=torch.full((n,), -1, dtype=torch.int64, device=dev),
            top_p=torch.ones(n, dtype=torch.float32, device=dev),
            min_p=torch.zeros(n, dtype=torch.float32, device=dev),
            seed=torch.zeros(n, dtype=torch.int64, device=dev), all_greedy=True, any_filter=False))


class StepScratch:
    """Device outputs of decode-only steps that only the next step reads (start, next_start):
    two buffers per (name, row count), used on alternate steps. Step N writes one while it reads
    step N-1's; by step N+1, which writes the other, every reader of step N-1's buffer has been
    enqueued before, on the same stream (no host or side-stream reader), so the reuse is ordered.
    Saves a ``torch.empty`` (~2 us of host time) per buffer per step."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: dict[tuple, torch.Tensor] = {}
        self._parity = 0

    def next_step(self) -> None:
        self._parity ^= 1

    def i64(self, name: str, n: int) -> torch.Tensor:
        """[n] int64, uninitialised: this step's buffer for ``name``."""
        key = (name, n, self._parity)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = torch.empty(n, dtype=torch.int64, device=self.device)
        return buf
