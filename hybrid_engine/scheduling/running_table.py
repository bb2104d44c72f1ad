"""The scheduler's running requests with their per-step counters as numpy columns.

Row i is ``reqs[i]`` (admission order). While a request runs, this table is the one owner of its
``num_computed_tokens``, ``num_inflight_steps`` and ``prefill_target``: ``Request``'s properties
read and write through here, and the scheduler's steady decode path updates every row with a
few numpy operations instead of a Python loop over the requests. On removal the values are
written back to the request, which owns them again while it waits or after it finished.
``add`` and ``remove`` are the only places a value moves between the two homes.

The other columns are not homes but host caches of Request fields, kept for the numpy steady
path: ``n_out`` (len(output_token_ids); the commit updates it), ``num_blocks`` (len(block_ids);
``blocks_changed``), ``epoch`` (fixed while running: a new epoch comes with a preemption, after
``remove``) and ``limit`` (constant while running).
"""
from __future__ import annotations

import numpy as np

from .request import Request


class RunningTable:
    def __init__(self, capacity: int):
        self.reqs: list[Request] = []
        z = lambda: np.zeros(capacity, dtype=np.int64)  # noqa: E731
        self.computed = z()         # [cap] num_computed_tokens (optimistic, see scheduler)
        self.inflight = z()         # [cap] num_inflight_steps
        self.prefill_target = z()   # [cap] tokens to prefill since the last (re)start
        self.n_out = z()            # [cap] len(output_token_ids) (kept by the scheduler's commits)
        self.limit = z()            # [cap] outputs allowed: min(max_tokens, max_model_len - prompt)
        self.num_blocks = z()       # [cap] len(block_ids)
        self.epoch = z()            # [cap]
        # rows moved (a removal) since this counter last changed: row indices held by a step's
        # DecodeRows stay valid while it is unchanged (admissions only append rows)
        self.version = 0
        self._ids: tuple[str, ...] | None = None          # cached req ids of all rows
        self._blocks: tuple[list[int], ...] | None = None  # cached block lists of all rows

    def __len__(self) -> int:
        return len(self.reqs)

    def add(self, req: Request, max_model_len: int) -> None:
        i = len(self.reqs)
        self.computed[i], self.inflight[i] = req._computed, req._inflight
        self.prefill_target[i] = req._prefill_target
        self.n_out[i] = len(req.output_token_ids)
        self.limit[i] = min(req.params.max_tokens, max_model_len - len(req.prompt_token_ids))
        self.num_blocks[i], self.epoch[i] = len(req.block_ids), req.epoch
        self.reqs.append(req)
        req._table, req._trow = self, i
        self._ids = self._blocks = None

    def remove(self, req: Request) -> None:
        i, n = req._trow, len(self.reqs)
        req._computed, req._inflight = int(self.computed[i]), int(self.inflight[i])
        req._prefill_target = int(self.prefill_target[i])
        req._table, req._trow = None, -1
        for col in (self.computed, self.inflight, self.prefill_target, self.n_out, self.limit,
                    self.num_blocks, self.epoch):
            col[i:n - 1] = col[i + 1:n]
        del self.reqs[i]
        for j in range(i, n - 1):
            self.reqs[j]._trow = j
        self.version += 1
        self._ids = self._blocks = None

    def blocks_changed(self, req: Request) -> None:
        self.num_blocks[req._trow] = len(req.block_ids)

    def ids(self) -> tuple[str, ...]:
        """Request ids of all rows; the same tuple object until a row is added or removed."""
        if self._ids is None:
            self._ids = tuple(r.request_id for r in self.reqs)
        return self._ids

    def block_lists(self) -> tuple[list[int], ...]:
        """Each row's block list (the live lists, which only grow while the request runs)."""
        if self._blocks is None:
            self._blocks = tuple(r.block_ids for r in self.reqs)
        return self._blocks
