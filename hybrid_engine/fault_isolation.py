"""What the step loop does when something raises: ``EngineCore``'s fault paths (a mixin).

The rule (one place for it): whatever raises in a phase of a step -- schedule, input preparation,
forward, sampling, drafting, the D2H copy, reading the output, the commit -- ends only the requests
of that step, with ``finish_reason="error"`` and ``error`` naming the cause; their slots, KV blocks
and batch rows are released through the scheduler (the batch rows leave at the next step's
removals), requests that were only waiting are untouched, and the next step works.

Why the step's requests are enough: a running request that decodes is in every step (decode rows
are scheduled before any budget check), so the only running requests missing from a failing step
are ones at their output limit (their last in-flight step finishes them) and prefill chunks (their
inputs come from the host). None of them reads the previous step's device outputs again, so the
runner can drop them (``runner.reset()``) when a launch fails part-way through.

A fault inside ``schedule()`` leaves no list of the step's rows: every running request may have
had its counters moved, so all running requests fail (waiting ones stay queued).

Non-finite logits are not an exception: the runner marks such rows in the step's one D2H payload
(``StepHandle`` reports them as ``ModelRunnerOutput.nonfinite_rows``) and the commit ends them
with an error instead of emitting their tokens.
"""
from __future__ import annotations

import logging

from .scheduling.request import Request

logger = logging.getLogger("hybrid_engine")


def is_fatal(error: BaseException) -> bool:
    """Errors that end the loop instead of a step's requests: KeyboardInterrupt & co, and errors
    marked ``fatal`` (``parallel.EngineDeadError``: a tensor-parallel rank is gone, so no step
    can run). Their step's requests are failed first, like any other."""
    return not isinstance(error, Exception) or getattr(error, "fatal", False)


def describe(error: BaseException, phase: str) -> str:
    return f"{phase} failed: {error!r}"


class FaultIsolation:
    """Mixed into EngineCore (uses self.scheduler, self.runner, self._inflight)."""
    _step_faulted = False       # the launch just made raised (read and cleared by begin_step)

    def fail_requests(self, reqs, message: str) -> list[Request]:
        """End ``reqs`` (unfinished ones) with ``finish_reason="error"`` and ``message``; their
        slots, blocks and batch rows are freed. -> the requests that were failed."""
        failed = self.scheduler.fail([r.request_id for r in reqs])
        for r in failed:
            r.error = message
        return failed

    def _live_rows(self, handle) -> list[Request]:
        """Requests of a step's rows that are still in the epoch the step ran them in."""
        get = self.scheduler.requests.get
        return [q for r in handle.sched.rows if (q := get(r.req_id)) is not None and q.epoch == r.epoch]

    def fail_schedule(self, error: BaseException) -> list[Request]:
        """``schedule()`` raised: every running request may be half-scheduled; fail them all."""
        logger.error("scheduling a step failed: %r; failing the running requests", error)
        self._step_faulted = True
        failed = self.fail_requests(list(self.scheduler.running), describe(error, "scheduling the step"))
        self.runner.reset()                 # no running request is left to read it
        return failed

    def fail_launch(self, sched, error: BaseException) -> list[Request]:
        """The runner raised while launching ``sched``: its rows fail, its removals are replayed."""
        logger.error("step %d failed at launch: %r", sched.step_id, error)
        self._step_faulted = True
        self.scheduler.requeue_removed(sched.removed_req_ids)
        self.runner.reset()                 # see the module docstring
        get = self.scheduler.requests.get
        reqs = [q for r in sched.rows if (q := get(r.req_id)) is not None and q.epoch == r.epoch]
        return self.fail_requests(reqs, describe(error, f"step {sched.step_id}"))

    def fail_step(self, handle, error: BaseException) -> list[Request]:
        """Reading or committing a step's output raised: its (current-epoch) requests fail.
        Returns every live request of the step (a partial commit may have finished some)."""
        logger.error("step %d output failed: %r", handle.sched.step_id, error)
        live = self._live_rows(handle)
        self.fail_requests(live, describe(error, f"step {handle.sched.step_id} output"))
        return live

    def fail_nonfinite(self, handle, out) -> list[Request]:
        """Rows whose logits were not finite (flagged by the runner): end them with an error
        before the commit, which then skips them."""
        rows = out.nonfinite_rows
        if rows is None or not len(rows):
            return []
        get = self.scheduler.requests.get
        by_id = {r.req_id: r for r in handle.sched.rows}
        reqs = []
        for i in rows.tolist():
            rid = out.req_ids[i]
            q, row = get(rid), by_id.get(rid)
            if q is not None and row is not None and q.epoch == row.epoch:
                reqs.append(q)
        logger.error("step %d: non-finite logits in rows of %s", handle.sched.step_id,
                     [r.request_id for r in reqs])
        return self.fail_requests(reqs, "non-finite logits (NaN or inf) in the model output; the "
                                         "request's tokens would be meaningless")

    def fail_all(self, error: BaseException) -> list[Request]:
        """Fail every unfinished request and drop the step in flight (the loop itself broke)."""
        self.drop_step_state()
        return self.fail_requests(list(self.scheduler.requests.values()), repr(error))

    def abort_all(self, message: str) -> list[Request]:
        """Abort every unfinished request (finish_reason "abort", ``error`` = message) and drop the
        step in flight: nothing will read its output (a cancelled step loop, an interrupt)."""
        self.drop_step_state()
        aborted = []
        for req in list(self.scheduler.requests.values()):
            if self.scheduler.abort(req.request_id):
                req.error = message
                aborted.append(req)
        return aborted

    def drop_step_state(self) -> None:
        """Forget the step in flight and the runner's previous-step outputs (nothing will read them)."""
        self._inflight = None
        self.runner.reset()
