"""Continuous batching: running decodes first, then prefill chunks, under a token budget.

Counting is optimistic: ``num_computed_tokens`` advances by every token scheduled (drafts
included) and is corrected one step late, when the step's accepted counts arrive. CPU counts are
therefore upper bounds; exact decode positions live on the device (runner).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable

from .attention.block_pool import BlockAllocator, NoFreeBlocks, blocks_needed
from .config import SchedulerConfig
from .request import Request, Status
from .scheduler_output import ModelRunnerOutput, NewRequestData, ScheduledRow, SchedulerOutput
from mamba_cache.pool import SlotAllocator

logger = logging.getLogger("hybrid_engine")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, *, max_model_len: int, block_size: int, num_kv_blocks: int,
                 num_slots: int, num_spec: int):
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_spec = num_spec
        self.decode_len = 1 + num_spec
        self.blocks = BlockAllocator(num_kv_blocks)
        self.slots = SlotAllocator(num_slots)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []          # admission order (oldest first)
        self._removed: set[str] = set()            # left the batch since the last schedule()
        self._step_id = 0
        self._epochs = 0                           # source of scheduler-unique request epochs

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        req.epoch = self._new_epoch()              # never equal to a finished namesake's in-flight rows
        self.waiting.append(req)

    def abort(self, req_id: str) -> bool:
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return False
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_finished(self, req_id: str) -> Request | None:
        return self.requests.pop(req_id, None)

    # ---- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        new: list[NewRequestData] = []
        # 1) running requests in admission order; preempt the newest when blocks run out
        dl, bs, k, max_len = self.decode_len, self.block_size, self.num_spec, self.max_model_len
        running_status = Status.RUNNING
        for req in list(self.running):
            if req.status is not running_status:
                continue                               # preempted earlier in this loop
            start = req.num_computed_tokens
            if start < req.prefill_target:             # prefilling
                n = min(req.prefill_target - start, budget)
                if n <= 0:
                    continue
                if not self._grow(req, start + n + self._lookahead(req, n)):
                    continue                           # req itself was preempted
                rows.append(self._row(req, n))
            else:
                # skip when in-flight steps already reach max_tokens / max_model_len (known lower
                # bounds of what the request has produced)
                inflight, n_out = req.num_inflight_steps, len(req.output_token_ids)
                if (n_out + inflight >= req.params.max_tokens
                        or len(req.prompt_token_ids) + n_out + inflight >= max_len):
                    continue
                n = dl
                need = start + n + k                   # + the drafters' lookahead
                # the common case (blocks already cover it) skips _grow's call
                if -(-need // bs) > len(req.block_ids) and not self._grow(req, need):
                    continue                           # req itself was preempted
                req.num_computed_tokens = start + n
                req.num_inflight_steps = inflight + 1
                rows.append(ScheduledRow(req.request_id, req.epoch, n, start, True, True, tuple(req.block_ids)))
            budget -= n
        # 2) admit waiting requests FCFS while a slot, blocks and token budget are available
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if (len(self.running) + 1) * self.decode_len > self.cfg.max_num_batched_tokens:
                break                                  # its decode steps would not fit beside the others
            target = req.num_tokens
            n = min(target, budget)
            need = blocks_needed(n + (self.num_spec if n == target else 0), self.block_size)
            if self.slots.num_free == 0 or self.blocks.num_free < need:
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate()
            req.block_ids = self.blocks.allocate(need)
            req.status, req.prefill_target, req.num_computed_tokens = Status.RUNNING, target, 0
            self.running.append(req)
            new.append(NewRequestData(req.request_id, req.epoch, tuple(req.all_token_ids), req.slot,
                                      req.params, req.seed))
            rows.append(self._row(req, n))
            budget -= n
        self._step_id += 1
        removed, self._removed = frozenset(self._removed), set()
        return SchedulerOutput(self._step_id, tuple(rows), tuple(new), removed, self.num_spec)

    def _lookahead(self, req: Request, n: int) -> int:
        """K positions past every row that samples: drafters write KV there while proposing."""
        samples = not req.is_prefilling or req.num_computed_tokens + n >= req.prefill_target
        return self.num_spec if samples else 0

    def _row(self, req: Request, n: int) -> ScheduledRow:
        decode = not req.is_prefilling
        start = req.num_computed_tokens
        req.num_computed_tokens += n
        samples = decode or req.num_computed_tokens >= req.prefill_target
        if samples:
            req.num_inflight_steps += 1
        return ScheduledRow(req.request_id, req.epoch, n, start, decode, samples, tuple(req.block_ids))

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make req's blocks cover num_tokens, preempting the newest running requests if needed."""
        need = blocks_needed(num_tokens, self.block_size) - len(req.block_ids)
        while need > 0:
            try:
                req.block_ids.extend(self.blocks.allocate(need))
                return True
            except NoFreeBlocks:
                victim = next(r for r in reversed(self.running) if r.status is Status.RUNNING)
                self._preempt(victim)
                if victim is req:
                    return False
        return True

    def _preempt(self, req: Request) -> None:
        logger.debug("preempting %s (recompute)", req.request_id)
        self._release(req)
        req.status, req.num_computed_tokens, req.prefill_target = Status.WAITING, 0, 0
        req.num_inflight_steps = 0
        req.epoch = self._new_epoch()                  # in-flight outputs of the old epoch are dropped
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def _new_epoch(self) -> int:
        """Epochs are unique across all requests, so a step row of a finished (and forgotten)
        request never matches a new request that reuses its request_id."""
        self._epochs += 1
        return self._epochs

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None
        if req.block_ids:
            self.blocks.free(req.block_ids)
            req.block_ids = []
        if req in self.running:
            self.running.remove(req)
            self._removed.add(req.request_id)

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        req.metrics.finish_time = time.perf_counter()

    # ---- results --------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Commit one step's tokens; returns the requests that got tokens or finished."""
        rows = {r.req_id: r for r in sched.rows}
        touched = []
        # host arrays -> Python ints once (numpy scalar access per element costs more than the work)
        num_valid, num_drafts = out.num_valid.tolist(), out.num_drafts.tolist()
        sampled = out.sampled.tolist()
        get, finished = self.requests.get, Status.FINISHED
        for i, req_id in enumerate(out.req_ids):
            row, req = rows[req_id], get(req_id)
            if req is None or req.status is finished or req.epoch != row.epoch or not row.samples:
                continue
            req.num_inflight_steps -= 1
            n_valid = num_valid[i]
            if row.is_decode:
                req.num_computed_tokens -= row.num_tokens - n_valid    # the one-step-late correction
                if self.num_spec:
                    self._record_spec(req, num_drafts[i], n_valid)
                else:
                    req.metrics.num_steps += 1
            self._append_tokens(req, sampled[i][:n_valid])
            touched.append(req)
        return touched

    def _record_spec(self, req: Request, drafts: int, n_valid: int) -> None:
        m = req.metrics
        m.num_steps += 1
        accepted = min(n_valid - 1, drafts)
        m.drafts_proposed += drafts
        m.drafts_accepted += accepted
        if len(m.accepted_per_position) < self.num_spec:
            m.accepted_per_position = [0] * self.num_spec
        for j in range(accepted):
            m.accepted_per_position[j] += 1

    def _append_tokens(self, req: Request, tokens: list[int]) -> None:
        p, m = req.params, req.metrics
        if m.first_token_time is None and tokens:
            m.first_token_time = time.perf_counter()
        stop_ids = req.stop_ids
        if stop_ids is None:            # built once per request: this loop runs for every token
            stop_ids = req.stop_ids = frozenset(
                p.stop_token_ids if p.ignore_eos else tuple(p.stop_token_ids) + tuple(req.eos_token_ids))
        out_ids = req.output_token_ids
        # stop at max_tokens or when prompt + outputs reach max_model_len, whichever comes first
        limit = min(p.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        for tok in tokens:
            out_ids.append(tok)
            m.num_tokens_out += 1
            if tok in stop_ids:
                self._finish(req, "stop")
                return
            if len(out_ids) >= limit:
                self._finish(req, "length")
                return

    def requeue_removed(self, req_ids: Iterable[str]) -> None:
        """A step that raised may not have reached the runner: report its removals again next step
        (removing a request that already left the batch is a no-op)."""
        self._removed.update(req_ids)

    def fail(self, req_ids: Iterable[str]) -> list[Request]:
        """Finish requests whose step raised; the others keep running."""
        failed = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is not None and not req.finished:
                if req.status is Status.WAITING:
                    self.waiting.remove(req)
                self._finish(req, "error")
                failed.append(req)
        return failed
