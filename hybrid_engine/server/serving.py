"""What completions and chat share: server state, admission (the bounded waiting queue), one
request's run on ``AsyncLLM`` and cancellation when the client disconnects.

A request's life: ``admit_and_start`` runs *without any await between the queue check and the
engine's ``add_request``* (both happen inside the first ``__anext__`` of ``AsyncLLM.generate``), so
``max_waiting_requests`` is a strict bound; it then waits for the first output, so a request that
fails in its first step is answered 500 before any byte is sent. ``until_disconnect`` runs that
(and, for non-streaming requests, the whole generation) as a child task raced against the client's
``http.disconnect``: when the client goes away the child is cancelled, which closes the engine
stream and aborts the request at once. A streaming response is watched by ``Run.outputs(http)``,
which aborts the engine request on disconnect (the server's own cancellation of the body iterator
is not relied on: it can miss a task that is woken by every engine step).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
import uuid
from dataclasses import dataclass

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .metrics import ServerMetrics
from .protocol import ApiError, bad_request

logger = logging.getLogger("hybrid_engine.server")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_waiting_requests: int = 1024
    api_key: str | None = None
    chat_template: str | None = None      # overrides the tokenizer's; None: the tokenizer's own

    def __post_init__(self):
        if not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be an integer >= 1, got {self.max_waiting_requests!r}")


class ClientDisconnected(Exception):
    """The client closed the connection; its request was aborted."""


class ServerState:
    """One per app: the engine, the served name, limits and metrics."""

    def __init__(self, llm, config: ServerConfig):
        self.llm, self.config = llm, config
        self.metrics = ServerMetrics(llm, config.model_name)
        self.closing = False
        self.created = int(time.time())
        self._drain_task: asyncio.Task | None = None

    def start_draining(self, grace_s: float) -> None:
        """Shutdown began: refuse new requests (503) and give in-flight ones ``grace_s`` seconds to
        finish; then abort the rest (their streams end with finish_reason "abort", non-streaming
        requests get 503) and stop the engine, so every connection closes cleanly."""
        if self.closing:
            return
        self.closing = True

        async def drain():
            await asyncio.sleep(grace_s)
            if self.llm.engine.has_work():
                logger.warning("aborting the requests still running after %.1fs of shutdown", grace_s)
            self.llm.shutdown()
        self._drain_task = asyncio.get_running_loop().create_task(drain())

    def close(self) -> None:
        """Final: abort anything left and stop the engine's step loop."""
        self.closing = True
        if self._drain_task is not None:
            self._drain_task.cancel()
        self.llm.shutdown()

    @property
    def max_model_len(self) -> int:
        return self.llm.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {self.config.model_name!r}",
                           param="model", code="model_not_found")

    def _admit(self) -> None:
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        waiting = self.llm.engine.occupancy()["num_requests_waiting"]
        if waiting >= self.config.max_waiting_requests:
            raise ApiError(429, f"the waiting queue is full ({waiting} requests, --max-waiting-requests="
                           f"{self.config.max_waiting_requests}); retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": "1"})

    async def admit_and_start(self, prompt, params: SamplingParams, prompt_field: str, prefix: str) -> "Run":
        """Queue the request (429 when the queue is full, 400 for what the engine rejects) and wait
        for its first output (500 if its first step failed)."""
        self._admit()
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        agen = self.llm.generate(prompt, params, request_id=request_id)
        try:
            first = await agen.__anext__()         # validation + add_request run before its first await
        except ValueError as e:
            raise bad_request(str(e), _engine_param(str(e), prompt_field)) from None
        except RuntimeError as e:                  # generate after shutdown
            raise ApiError(503, f"the server is shutting down: {e}", type="server_error",
                           code="shutting_down") from None
        except asyncio.CancelledError:           # the client left while the request was queued
            self.metrics.aborted.inc()
            await agen.aclose()
            raise
        except BaseException:
            await agen.aclose()
            raise
        run = Run(self, request_id, agen, first, params.n)
        if first.finished and first.error is not None:
            await run.close()
            raise run.error()
        return run


def _engine_param(message: str, prompt_field: str) -> str | None:
    """Which request field an engine ValueError is about."""
    m = re.match(r"SamplingParams\.(\w+)", message)
    if m:
        return m.group(1)
    if message.startswith("SamplingParams.n="):
        return "n"
    if "max_tokens" in message:
        return "max_tokens"
    if message.startswith(("prompt", "request_id")):
        return prompt_field
    return None


class Sample:
    """What one of a request's ``n`` samples (a choice) produced so far."""
    __slots__ = ("token_ids", "logprobs", "texts", "finish_reason", "stop_reason")

    def __init__(self):
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []              # per token, when the request asked for logprobs
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None


class Run:
    """One admitted request: its engine stream, accumulated output (one ``Sample`` per choice) and
    metrics bookkeeping."""

    def __init__(self, state: ServerState, request_id: str, agen, first: RequestOutput, n: int = 1):
        self.state, self.request_id, self._agen, self._first = state, request_id, agen, first
        self.prompt_token_ids = first.prompt_token_ids
        self.prompt_logprobs = first.prompt_logprobs    # per prompt token (SamplingParams.prompt_logprobs)
        self.samples = [Sample() for _ in range(n)]
        self.last: RequestOutput | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def logprobs(self) -> list[dict]:
        return self.samples[0].logprobs

    @property
    def usage(self) -> dict:
        p, c = len(self.prompt_token_ids), sum(len(s.token_ids) for s in self.samples)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @property
    def finish_reason(self) -> str | None:
        return self.samples[0].finish_reason

    @property
    def stop_reason(self) -> str | None:
        """The stop string that ended the request, if one did."""
        return self.samples[0].stop_reason

    def error(self) -> ApiError:
        """The 500 of a request whose engine step failed."""
        return ApiError(500, f"generation failed: {self.last.error}", type="server_error", code="engine_step_failed")

    async def outputs(self, http=None):
        """Every delta from the first on; closes the engine stream (aborting an unfinished request)
        when the consumer stops or is cancelled. With ``http`` (a streaming response) a watcher
        aborts the request in the engine as soon as the client disconnects, so the stream ends
        with finish_reason "abort" without relying on the body iterator being cancelled."""
        watcher = asyncio.ensure_future(self._abort_on_disconnect(http)) if http is not None else None
        try:
            out = self._first
            while True:
                self._record(out)
                yield out
                if out.finished:
                    return
                out = await self._agen.__anext__()
        finally:
            if watcher is not None:
                watcher.cancel()
            await self.close()

    async def _abort_on_disconnect(self, http) -> None:
        await _wait_disconnect(http)
        await self.state.llm.abort(self.request_id)

    def _record(self, out: RequestOutput) -> None:
        for c in out.outputs:
            s = self.samples[c.index]
            s.token_ids += c.token_ids
            s.logprobs += c.logprobs or ()
            s.texts.append(c.text or "")
            if c.finish_reason is not None:
                s.finish_reason, s.stop_reason = c.finish_reason, c.stop_reason
        self.last = out
        if out.finished:
            self.state.metrics.observe_finished(out, sum(len(s.token_ids) for s in self.samples))

    async def close(self) -> None:
        if self.last is None:
            self._record(self._first)
        if not self.last.finished:
            self.state.metrics.aborted.inc()
        await self._agen.aclose()

    async def collect(self) -> list[str]:
        """Run to the end; returns each sample's full text. A failed step is a 500, an abort
        (shutdown) a 503."""
        async for _ in self.outputs():
            pass
        if self.last.error is not None:
            raise self.error()
        if self.finish_reason == "abort":
            raise ApiError(503, "the request was aborted (server shutting down)", type="server_error",
                           code="aborted")
        return ["".join(s.texts) for s in self.samples]


async def until_disconnect(request, coro):
    """Await ``coro`` in a child task, cancelling it if the client disconnects first (then raise
    ``ClientDisconnected``). If this handler itself is cancelled, the child is cancelled too."""
    work = asyncio.ensure_future(coro)
    listener = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        listener.cancel()
        raise
    listener.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    raise ClientDisconnected


async def _wait_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
