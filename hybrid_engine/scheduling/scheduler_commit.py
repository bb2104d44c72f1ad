"""The commit of step outputs (``Scheduler.update_from_output``): tokens appended, counters
corrected one step late, stop and length limits applied. ``OutputCommitter`` is the scheduler's
collaborator: it is handed the scheduler's request map and running table (it owns neither) and a
``finish`` callback (finishing frees the slot and blocks, which is the scheduler's business); the
stop-id cache is its own.

A steady step (``SchedulerOutput.decode`` set, and no table row moved since it was scheduled)
commits its decode rows with numpy operations on the table; only rows whose tokens may finish
them (a stop id, the length limit, or stop strings) take the per-token path. Everything else is
committed row by row. Stop strings: after each appended token the request's ``StopStrings``
(sampling/stop_strings.py) detokenises it and searches the new text; a match finishes the
request at that token, so the rest of a verified run of drafts is dropped.
"""
from __future__ import annotations

import time

import numpy as np

from typing import Callable

from ..sampling.logprobs import entry as logprob_entry
from .request import Request, Status
from .running_table import RunningTable
from .scheduler_output import DecodeRows, ModelRunnerOutput, ScheduledRow, SchedulerOutput


class OutputCommitter:
    def __init__(self, *, requests: dict[str, Request], table: RunningTable, num_spec: int, max_model_len: int,
                 finish: Callable[[Request, str], None]):
        self.requests = requests        # the scheduler's: request id -> Request (read only here)
        self.table = table              # the scheduler's running table (counters updated here)
        self.num_spec, self.max_model_len = num_spec, max_model_len
        self._finish = finish           # Scheduler._finish: frees slot + blocks, status FINISHED
        # (running req-id tuple the union was built for, every stop id of those requests,
        #  [rows] bool: the table row's request is committed token by token: stop strings, logprobs)
        self._stop_cache: tuple[tuple[str, ...] | None, np.ndarray, np.ndarray] = (
            None, np.zeros(0, np.int64), np.zeros(0, bool))

    def commit(self, sched: SchedulerOutput, out: ModelRunnerOutput) -> list[Request]:
        """Commit one step's tokens; returns the requests that got tokens or finished."""
        if out.prompt_logprobs:
            self._file_prompt_logprobs(out.prompt_logprobs)
        steady = sched.decode
        if steady is None or steady.table_version != self.table.version:
            return self._update_rows(sched.rows, out, 0)
        # no row moved since the step was scheduled: its rows are all live, in their epochs
        touched = self._update_steady(steady, out)
        if sched.other_rows:
            touched += self._update_rows(sched.other_rows, out, len(steady))
        return touched

    def _update_steady(self, d: DecodeRows, out: ModelRunnerOutput) -> list[Request]:
        """``_update_rows`` for a steady step's decode rows: the counters as numpy operations; only
        rows whose tokens may finish them (a stop id among them, or the length limit reached) take
        the per-token path, after the others (finishing moves table rows)."""
        table, n, k = self.table, len(d), self.num_spec
        idx = d.table_rows                                                 # [n]
        num_valid, sampled = out.num_valid[:n], out.sampled[:n]            # [n], [n, 1+K]
        table.inflight[idx] -= 1
        table.computed[idx] -= d.num_tokens - num_valid                    # the one-step-late correction
        n_out = table.n_out[idx] + num_valid
        table.n_out[idx] = n_out
        risky = n_out >= table.limit[idx]
        stops, per_token = self._stop_union()
        if stops.size:
            risky |= np.isin(sampled, stops).any(1)                        # -1 pads never match
        if per_token.any():
            risky |= per_token[idx]                    # stop strings searched / logprobs kept per token
        reqs = table.reqs
        touched = [reqs[j] for j in idx.tolist()]                          # [n] in step-row order
        now = None
        if not k:
            toks = sampled[:, 0].tolist()
            for req, tok, bad in zip(touched, toks, risky.tolist()):
                if bad:
                    continue
                req.output_token_ids.append(tok)
                m = req.metrics
                m.num_steps += 1
                m.num_tokens_out += 1
                if m.first_token_time is None:
                    m.first_token_time = now = now or time.perf_counter()
        else:
            valid_l, drafts_l, sampled_l = num_valid.tolist(), out.num_drafts[:n].tolist(), sampled.tolist()
            for i, (req, bad) in enumerate(zip(touched, risky.tolist())):
                if bad:
                    continue
                req.output_token_ids.extend(sampled_l[i][:valid_l[i]])
                self._record_spec(req, drafts_l[i], valid_l[i])
                m = req.metrics
                m.num_tokens_out += valid_l[i]
                if m.first_token_time is None:
                    m.first_token_time = now = now or time.perf_counter()
        if risky.any():
            sampled_l = sampled.tolist()
            for i in np.flatnonzero(risky).tolist():
                req = touched[i]
                if k:
                    self._record_spec(req, int(out.num_drafts[i]), int(num_valid[i]))
                else:
                    req.metrics.num_steps += 1
                self._append_tokens(req, sampled_l[i][:int(num_valid[i])],
                                    None if out.logprobs is None else out.logprobs[i])
        return touched

    def _stop_union(self) -> tuple[np.ndarray, np.ndarray]:
        """Every stop id of the running requests (EOS unless ignore_eos), and per table row whether
        its request has stop strings; cached per composition."""
        ids = self.table.ids()
        if self._stop_cache[0] is not ids:
            u: set[int] = set()
            for r in self.table.reqs:
                p = r.params
                u.update(p.stop_token_ids)
                if not p.ignore_eos:
                    u.update(r.eos_token_ids)
            strings = np.fromiter((r.stop_strings is not None or r.output_logprobs is not None
                                   for r in self.table.reqs), dtype=bool, count=len(self.table.reqs))
            self._stop_cache = (ids, np.array(sorted(u), dtype=np.int64), strings)
        return self._stop_cache[1], self._stop_cache[2]

    def _update_rows(self, step_rows: tuple[ScheduledRow, ...], out: ModelRunnerOutput,
                     offset: int) -> list[Request]:
        """Commit the output rows from ``offset`` on, one by one (rows: the step's rows among them)."""
        rows = {r.req_id: r for r in step_rows}
        touched = []
        # host arrays -> Python ints once (numpy scalar access per element costs more than the work)
        num_valid, num_drafts = out.num_valid.tolist(), out.num_drafts.tolist()
        sampled = out.sampled.tolist()
        get, finished = self.requests.get, Status.FINISHED
        for i in range(offset, len(out.req_ids)):
            req_id = out.req_ids[i]
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
            self._append_tokens(req, sampled[i][:n_valid], None if out.logprobs is None else out.logprobs[i])
            touched.append(req)
        return touched

    def _file_prompt_logprobs(self, spans) -> None:
        """Prompt logprobs by position (a chunk recomputed after preemption writes equal values)."""
        for span, values in spans:
            req = self.requests.get(span.req_id)
            if req is None or req.epoch != span.epoch or req.prompt_logprobs is None:
                continue
            ids, n, kept = req.prompt_token_ids, req.params.prompt_logprobs, req.prompt_logprobs
            for i in range(span.count):
                pos = span.start + i
                kept[pos] = logprob_entry(values[i], ids[pos], n)

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

    def _append_tokens(self, req: Request, tokens: list[int], logprobs: np.ndarray | None = None) -> None:
        """Append a row's valid tokens one by one until one finishes the request; ``logprobs``
        [1+K, 1+2N] the row's logprobs block (kept for requests that asked)."""
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
        strings = req.stop_strings
        kept = req.output_logprobs if logprobs is not None else None
        for i, tok in enumerate(tokens):
            out_ids.append(tok)
            m.num_tokens_out += 1
            if kept is not None:
                kept.append(logprob_entry(logprobs[i], tok, p.logprobs))
            if tok in stop_ids:
                self._finish(req, "stop")
                return
            if strings is not None and strings.push(out_ids):
                self._finish(req, "stop")
                return
            if len(out_ids) >= limit:
                self._finish(req, "length")
                return
        if req._table is self.table:
            self.table.n_out[req._trow] = len(out_ids)
