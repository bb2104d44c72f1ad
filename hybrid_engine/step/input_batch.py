"""Persistent per-row request arrays (CPU numpy), with add / remove / condense.

A request occupies one *row* from add to remove; condense() moves the last rows into holes so rows
0..num_reqs-1 are dense. Previous-step device outputs are never indexed by row: they stay in the
previous step's *step-row* layout and are read through ``prev_positions`` (docs/design.md invariant 6).
"""
from __future__ import annotations

import numpy as np

from ..scheduling.scheduler_output import NewRequestData

PLACEHOLDER = -1


class InputBatch:
    def __init__(self, max_rows: int, max_model_len: int, max_blocks: int):
        self.max_rows = max_rows
        self.req_ids: list[str | None] = [None] * max_rows
        self.req_id_to_row: dict[str, int] = {}
        # token_ids_cpu[row, :num_tokens_no_spec[row]]: prompt + committed outputs, then -1
        # placeholders appended for tokens sampled by steps whose output the host has not read yet.
        self.token_ids_cpu = np.full((max_rows, max_model_len), PLACEHOLDER, dtype=np.int64)
        self.num_tokens_no_spec = np.zeros(max_rows, dtype=np.int64)
        self.num_prefill_tokens = np.zeros(max_rows, dtype=np.int64)   # tokens to prefill (prompt+resume)
        self.slot = np.zeros(max_rows, dtype=np.int64)
        self.epoch = np.zeros(max_rows, dtype=np.int64)
        self.block_table = np.zeros((max_rows, max_blocks), dtype=np.int32)  # 0 = null block
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.temperature = np.zeros(max_rows, dtype=np.float32)
        self.top_k = np.full(max_rows, -1, dtype=np.int64)
        self.top_p = np.ones(max_rows, dtype=np.float32)
        self.min_p = np.zeros(max_rows, dtype=np.float32)
        self.seed = np.zeros(max_rows, dtype=np.int64)
        self.processed = np.zeros(max_rows, dtype=bool)     # logits processed (sampling/logits_processing.py)
        self.logprobs = np.full(max_rows, -1, dtype=np.int64)  # SamplingParams.logprobs, -1 = None
        self.num_logprob_rows = 0                            # live rows with logprobs >= 0
        self.prompt_logprobs = np.full(max_rows, -1, dtype=np.int64)  # SamplingParams.prompt_logprobs, -1 = None
        self.num_prompt = np.zeros(max_rows, dtype=np.int64)  # prompt tokens (token_ids_cpu[row, :num_prompt])
        self.num_prompt_logprob_rows = 0                     # live rows with prompt_logprobs >= 0
        self._row_arrays = [self.token_ids_cpu, self.num_tokens_no_spec, self.num_prefill_tokens, self.slot,
                            self.epoch, self.block_table, self.num_blocks, self.temperature, self.top_k,
                            self.top_p, self.min_p, self.seed, self.processed, self.logprobs,
                            self.prompt_logprobs, self.num_prompt]
        self._holes: list[int] = []
        self.num_rows = 0                       # rows 0..num_rows-1 in use or holes
        # req_id -> step row in the previous step's outputs (set_prev, by the runner after each step)
        self.prev_req_id_to_index: dict[str, int] = {}
        self._prev_req_ids: tuple[str, ...] | None = None
        # steady decode hands the same req-id tuple object back step after step: its batch rows
        # are cached until a row moves (add / remove / condense bump layout_version)
        self.layout_version = 0
        self._rows_cache: tuple = (None, -1, None)
        self._arange = np.arange(max_rows)
        self._arange.flags.writeable = False

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_row)

    def add_request(self, new: NewRequestData) -> int:
        """Place a request in a free row, resetting every per-row field (a reused row starts clean)."""
        if new.req_id in self.req_id_to_row:
            raise ValueError(f"request {new.req_id!r} is already in the batch")
        row = self._holes.pop() if self._holes else self.num_rows
        if row >= self.max_rows:
            raise RuntimeError("input batch is full")
        self.num_rows = max(self.num_rows, row + 1)
        n = len(new.token_ids)
        self.token_ids_cpu[row] = PLACEHOLDER
        self.token_ids_cpu[row, :n] = new.token_ids
        self.num_tokens_no_spec[row] = n
        self.num_prefill_tokens[row] = n
        self.slot[row], self.epoch[row] = new.slot, new.epoch
        self.block_table[row] = 0
        self.num_blocks[row] = 0
        p = new.params
        self.temperature[row], self.top_k[row], self.top_p[row], self.min_p[row] = (
            p.temperature, p.top_k, p.top_p, p.min_p)
        self.seed[row] = new.seed
        self.processed[row] = new.processing is not None
        self.logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_logprob_rows += p.logprobs is not None
        self.prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.num_prompt_logprob_rows += p.prompt_logprobs is not None
        self.num_prompt[row] = new.num_prompt_tokens
        self.req_ids[row] = new.req_id
        self.req_id_to_row[new.req_id] = row
        self.layout_version += 1
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            self.num_logprob_rows -= bool(self.logprobs[row] >= 0)
            self.logprobs[row] = -1
            self.num_prompt_logprob_rows -= bool(self.prompt_logprobs[row] >= 0)
            self.prompt_logprobs[row] = -1
            self.req_ids[row] = None
            self._holes.append(row)
            self.layout_version += 1
        return row

    def condense(self) -> None:
        """Move the last live rows into holes so rows 0..num_reqs-1 are dense."""
        holes = sorted(self._holes)
        self._holes = []
        last = self.num_rows - 1
        for hole in holes:
            while last >= 0 and self.req_ids[last] is None:
                last -= 1
            if hole >= last:
                break
            self._move(last, hole)
            last -= 1
        self.num_rows = self.num_reqs

    def _move(self, src: int, dst: int) -> None:
        for arr in self._row_arrays:
            arr[dst] = arr[src]
        req_id = self.req_ids[src]
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.req_id_to_row[req_id] = dst
        self.layout_version += 1

    def set_blocks(self, row: int, block_ids) -> None:
        """The row's block list is now ``block_ids`` (a sequence of n ids). A running request's list
        only grows (blocks are appended; a preempted request comes back in a fresh row), so only
        the ids past the ``num_blocks[row]`` already written are copied: a long-context row would
        otherwise rewrite its whole list (8192 ids at 128k tokens: ~180 us) each time it grows."""
        n, old = len(block_ids), int(self.num_blocks[row])
        if n != old:
            if n > self.block_table.shape[1]:
                raise RuntimeError(f"request needs {n} blocks > table width {self.block_table.shape[1]}")
            start = old if n > old else 0            # (a shorter list: written whole)
            self.block_table[row, start:n] = block_ids[start:n]
            self.num_blocks[row] = n

    def rows_of(self, req_ids: tuple[str, ...]) -> np.ndarray:
        """[N] batch rows of these requests (read only). Cached for the same tuple object while no
        row moved: steady decode looks them up once, not every step."""
        c = self._rows_cache
        if c[0] is req_ids and c[1] == self.layout_version:
            return c[2]
        get = self.req_id_to_row.__getitem__
        rows = np.fromiter((get(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
        rows.flags.writeable = False
        self._rows_cache = (req_ids, self.layout_version, rows)
        return rows

    def set_prev(self, req_ids: tuple[str, ...]) -> None:
        """The step just launched had these rows, in this order: its outputs are the previous
        step's outputs of the next one."""
        if req_ids is not self._prev_req_ids:
            self._prev_req_ids = req_ids
            self.prev_req_id_to_index = {rid: i for i, rid in enumerate(req_ids)}

    def prev_positions(self, req_ids) -> np.ndarray:
        """For each request, its step row in the previous step's outputs, or -1 (read only)."""
        if req_ids is self._prev_req_ids:             # the same rows as the previous step
            return self._arange[:len(req_ids)]
        get = self.prev_req_id_to_index.get
        return np.fromiter((get(r, -1) for r in req_ids), dtype=np.int64, count=len(req_ids))

    def stage_decode(self, rows: np.ndarray, prev_idx: np.ndarray, header: bool = False) -> tuple[np.ndarray, int]:
        """``prepare_decode``'s staged array for these batch rows -> (array, W): [prev (N), slot (N),
        block-table rows (N x W)], W the widest row's block count; ``header``: [N, W] first."""
        n, h = len(rows), 2 if header else 0
        block_cols = max(int(self.num_blocks[rows].max()), 1)
        host = np.empty(h + 2 * n + n * block_cols, dtype=np.int64)
        if header:
            host[0], host[1] = n, block_cols
        host[h:h + n] = prev_idx
        host[h + n:h + 2 * n] = self.slot[rows]
        host[h + 2 * n:].reshape(n, block_cols)[:] = self.block_table[rows, :block_cols]
        return host, block_cols

    def backup_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Last committed token per row: index num_tokens_no_spec - 1, never a placeholder (docs/design.md invariant 5).

        Only rows that sampled nothing use it (partial prefill chunks), and those rows have had no
        placeholder appended, so index num_tokens_no_spec - 1 is a prefill token.
        """
        return self.token_ids_cpu[rows, self.num_tokens_no_spec[rows] - 1]

    def append_placeholders(self, rows: np.ndarray) -> None:
        """One -1 per row that sampled this step: the cursor counts tokens the host has not seen yet.

        Only the cursor moves: every cell past a row's tokens already holds PLACEHOLDER (add_request
        fills the whole row, condense moves whole rows, and nothing else writes token_ids_cpu)."""
        self.num_tokens_no_spec[rows] += 1
