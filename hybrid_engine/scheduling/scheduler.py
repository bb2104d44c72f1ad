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

import numpy as np

from ..attention.block_pool import BlockAllocator, CachingBlockAllocator, NoFreeBlocks, blocks_needed
from .prefix_cache import NoPrefixCache
from ..config import SchedulerConfig
from .request import Request, Status
from .running_table import RunningTable
from .fork import PrefillFork
from .scheduler_commit import OutputCommitter
from .scheduler_output import DecodeRows, ModelRunnerOutput, NewRequestData, ScheduledRow, SchedulerOutput
from hybrid_engine.mamba_cache.pool import SlotAllocator

logger = logging.getLogger("hybrid_engine")


class Scheduler(PrefillFork):
    def __init__(self, cfg: SchedulerConfig, *, max_model_len: int, block_size: int, num_kv_blocks: int,
                 num_slots: int, num_spec: int, prefix_cache=None):
        """``prefix_cache``: None (off) or ``f(blocks) -> PrefixCache`` building the cache on the
        scheduler's block pool (a ``CachingBlockAllocator`` then)."""
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_spec = num_spec
        self.decode_len = 1 + num_spec
        if prefix_cache is None:
            self.blocks = BlockAllocator(num_kv_blocks)
            self.prefix = NoPrefixCache()
        else:
            self.blocks = CachingBlockAllocator(num_kv_blocks)
            self.prefix = prefix_cache(self.blocks)
        self.slots = SlotAllocator(num_slots)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.table = RunningTable(cfg.max_num_seqs)  # running requests (admission order) + counters
        self._arange = np.arange(cfg.max_num_seqs)
        self._arange.flags.writeable = False
        self._removed: set[str] = set()            # left the batch since the last schedule()
        self._step_id = 0
        self._epochs = 0                           # source of scheduler-unique request epochs
        self._forked_new: list[NewRequestData] = []  # siblings admitted by a fork step (fork.py)
        self._fork_blocked = False                 # a leader waits at its fork: admit nobody new
        self._committer = OutputCommitter(requests=self.requests, table=self.table, num_spec=num_spec,
                                          max_model_len=max_model_len, finish=self._finish)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if req.fork_pending:
            self._register_group(req)
        self.requests[req.request_id] = req
        req.epoch = self._new_epoch()              # never equal to a finished namesake's in-flight rows
        self.waiting.append(req)

    def abort(self, req_id: str) -> bool:
        req = self.requests.get(req_id)
        if req is None or req.finished:
            return False
        if req.status is Status.WAITING:
            self._unqueue(req)
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def running(self) -> list[Request]:
        """Running requests, oldest first (the table's rows; change them through the table)."""
        return self.table.reqs

    def pop_finished(self, req_id: str) -> Request | None:
        return self.requests.pop(req_id, None)

    # ---- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        self.prefix.begin_step()
        rows: list[ScheduledRow] = []
        new: list[NewRequestData] = []
        # 1) running requests in admission order; preempt the newest when blocks run out
        decode = self._schedule_steady()
        if decode is not None:
            budget -= len(decode) * self.decode_len
        else:
            budget = self._schedule_running(rows, budget)
        # 2) admit waiting requests FCFS while a slot, blocks and token budget are available
        # (nobody while an n > 1 group waits for room to fork: fork.py)
        blocked, self._fork_blocked = self._fork_blocked, False
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs and not blocked:
            req = self.waiting[0]
            if (len(self.running) + 1) * self.decode_len > self.cfg.max_num_batched_tokens:
                break                                  # its decode steps would not fit beside the others
            target = req.num_tokens
            # a cached prefix is restored, not computed (an n > 1 leader prefills from scratch: the
            # fork copies the leader's state at P-1, which a restore would not have written; so
            # does a request that asked for prompt logprobs: every prompt position needs its logits)
            hit = self.prefix.match(req, 0 if req.fork_pending or req.prompt_logprobs is not None else target)
            start = hit.num_tokens
            n = min(target - start, budget)
            if req.fork_pending:
                n = self._fork_cut(req, 0, n)
            need = blocks_needed(start + n + (self.num_spec if start + n == target else 0),
                                 self.block_size) - len(hit.blocks)
            if self.slots.num_free == 0 or self.blocks.num_free - self.prefix.num_unreferenced(hit) < need:
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate()
            self.prefix.take(req, hit)                 # before allocating: evictions never take a hit block
            req.block_ids = list(hit.blocks) + self.blocks.allocate(need)
            req.status, req.prefill_target, req.num_computed_tokens = Status.RUNNING, target, start
            self.table.add(req, self.max_model_len)
            new.append(NewRequestData(req.request_id, req.epoch, tuple(req.all_token_ids), req.slot,
                                      req.params, req.seed, num_prompt_tokens=len(req.prompt_token_ids),
                                      processing=req.processing))
            rows.append(self._row(req, n)._replace(restore_row=hit.row))
            budget -= n
        if self._forked_new:
            new.extend(self._forked_new)
            self._forked_new.clear()
        self._step_id += 1
        removed, self._removed = frozenset(self._removed), set()
        return SchedulerOutput(self._step_id, tuple(rows), tuple(new), removed, self.num_spec, decode)

    def _schedule_steady(self) -> DecodeRows | None:
        """The running loop as numpy operations when every running request decodes (the steady
        state of serving); None when one prefills, none runs, or growing blocks preempted one
        (``_schedule_running`` takes those steps). Same rows, same counters as that loop."""
        t, n = self.table, len(self.table)
        if not n:
            return None
        computed = t.computed[:n]
        if (computed < t.prefill_target[:n]).any():
            return None
        dl, k = self.decode_len, self.num_spec
        # skip rows whose in-flight steps already reach their limit (see _schedule_running)
        sel = t.n_out[:n] + t.inflight[:n] < t.limit[:n]                 # [n] bool
        if not sel.any():
            return None                                # no row to run: DecodeRows is never empty
        need = computed + (dl + k)                                         # [n] tokens to cover
        grow = sel & (need > t.num_blocks[:n] * self.block_size)
        grow_rows: list[int] = []
        if grow.any():
            version = t.version
            grow_rows = np.flatnonzero(grow).tolist()
            for i, tokens in zip(grow_rows, need[grow].tolist()):
                self._grow(t.reqs[i], tokens)
                if t.version != version:
                    return None                        # a preemption moved rows: the per-row loop
        if sel.all():
            table_rows, ids, blocks, grown = self._arange[:n], t.ids(), t.block_lists(), tuple(grow_rows)
        else:
            table_rows = np.flatnonzero(sel)
            rl = table_rows.tolist()
            ids = tuple(t.reqs[i].request_id for i in rl)
            blocks = tuple(t.reqs[i].block_ids for i in rl)
            grown = tuple(np.searchsorted(table_rows, grow_rows).tolist())
        start = computed[table_rows]                                       # a copy (fancy index)
        t.computed[table_rows] = start + dl
        t.inflight[table_rows] += 1
        return DecodeRows(ids, t.epoch[table_rows], start, dl, blocks, grown, table_rows, t.version)

    def _schedule_running(self, rows: list[ScheduledRow], budget: int) -> int:
        """Schedule the running requests one by one (prefill chunks, decode rows); returns the
        token budget left."""
        dl, bs, k, max_len = self.decode_len, self.block_size, self.num_spec, self.max_model_len
        running_status = Status.RUNNING
        for req in list(self.running):
            if req.status is not running_status:
                continue                               # preempted earlier in this loop
            start = req.num_computed_tokens
            if start < req.prefill_target:             # prefilling
                n = min(req.prefill_target - start, budget)
                if req.fork_pending and n > 0:         # an n > 1 leader (fork.py)
                    n = self._fork_cut(req, start, n)
                    if start + n == len(req.prompt_token_ids):
                        if not self._grow(req, start + n + self._lookahead(req, n)):
                            continue                   # req itself was preempted
                        used = self._fork_step(req, rows, budget - n)
                        if used < 0:
                            continue                   # siblings do not fit yet: wait at P-1
                        budget -= used
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
        return budget

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
        saves = () if decode else self.prefix.plan_chunk(req, start, n, self._step_id + 1)
        return ScheduledRow(req.request_id, req.epoch, n, start, decode, samples, tuple(req.block_ids),
                            ckpt_saves=saves)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Make req's blocks cover num_tokens, preempting the newest running requests if needed."""
        need = blocks_needed(num_tokens, self.block_size) - len(req.block_ids)
        while need > 0:
            try:
                req.block_ids.extend(self.blocks.allocate(need))
                self.table.blocks_changed(req)
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
        self.prefix.drop(req)
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None
        if req.block_ids:
            self.blocks.free(req.block_ids)
            req.block_ids = []
        if req._table is self.table:
            self.table.remove(req)
            self._removed.add(req.request_id)

    def _finish(self, req: Request, reason: str) -> None:
        if req.fork_pending:
            self._release_siblings(req)
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        req.metrics.finish_time = time.perf_counter()

    # ---- results ---------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Commit one step's tokens (scheduler_commit.OutputCommitter); returns the requests that
        got tokens or finished."""
        self.prefix.commit(sched.step_id)            # publish the blocks / checkpoints it computed
        return self._committer.commit(sched, out)

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
                    self._unqueue(req)
                self._finish(req, "error")
                failed.append(req)
        return failed
