"""Streaming API: ``AsyncLLM(model=...)`` with ``async for out in engine.generate(...)``.

One asyncio task (the *step loop*, started lazily on the running event loop by the first
``generate``) drives ``EngineCore`` with one step in flight:

    handle, failed = engine.begin_step()      # launch step N+1 (async) / step N (sync)
    await asyncio.sleep(0)                    # consumers, new requests and aborts run here
    out = await handle.result_async()         # step N's output, without blocking the event loop
    engine.finish_step(handle, out)           # commit: counters, stop checks -> streams wake up

This is the same ``begin_step``/``finish_step`` pair that ``LLM.generate`` drives through
``EngineCore.step()``, so both APIs give identical tokens. With ``async_scheduling=False``
``begin_step`` hands back the new step's own handle. When nothing is left to run the loop sleeps on
an ``asyncio.Event`` that ``generate`` sets.

Streams: every yielded ``RequestOutput`` is a *delta*: ``outputs[0].token_ids`` holds only the
tokens committed since the previous yield (a slow consumer gets several steps' tokens at once),
``outputs[0].text`` the matching text (incremental detokenisation; ``None`` without a tokenizer).
The last item has ``finished=True`` and ``finish_reason`` set:
  "stop" | "length"   normal end;
  "abort"             ``abort(request_id)``, the consumer stopped iterating, or ``shutdown()``;
  "error"             a step carrying the request raised (in any phase), its logits were not
                      finite, or its output could not be built: the stream *ends normally* (it
                      does not raise) with ``RequestOutput.error`` naming the cause; the other
                      requests keep running (hybrid_engine/fault_isolation.py).
If the step-loop task itself is cancelled, every stream ends at once with finish_reason "abort"
and an ``error`` saying so; the next ``generate`` starts a new loop.
Validation errors (bad prompt or params, a request_id already streaming) raise ``ValueError`` at
the first ``__anext__``, before anything is queued. After ``shutdown()`` ``generate`` raises
``RuntimeError``.

Use one AsyncLLM from one event loop (and one thread). A consumer that breaks out of ``async for``
aborts its request when the generator is closed; asyncio closes abandoned async generators soon
after they are dropped, and ``contextlib.aclosing`` makes it immediate.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

from .fault_isolation import is_fatal
from .llm import build_engine, error_output
from .outputs import RequestOutput
from .scheduling.request import Request
from .sampling_params import SamplingParams

logger = logging.getLogger("hybrid_engine")


class _Stream:
    """Consumer-side state of one request: how much of it has been handed out."""
    __slots__ = ("req", "event", "sent", "prefix_offset", "read_offset", "chars_sent", "done")

    def __init__(self, req: Request, event: asyncio.Event):
        self.req = req
        self.event = event                # set by the step loop when the request got tokens/finished
        self.done = False                 # its last output was yielded
        self.sent = 0                     # output tokens already yielded
        self.prefix_offset = 0            # incremental detokenisation window (see _text_delta)
        self.read_offset = 0
        self.chars_sent = 0               # requests with stop strings: characters of their text yielded


class AsyncLLM:
    """Streaming generation. Arguments as ``LLM`` (docs/design.md, "Public API"); ``model=None`` uses the
    embedded default model."""

    def __init__(self, model=None, **engine_args):
        self.engine = build_engine(model, **engine_args)
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._closed = False

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    @property
    def is_running(self) -> bool:
        """True while the step loop task is alive."""
        return self._task is not None and not self._task.done()

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """Stream ``RequestOutput`` deltas for one prompt (str or list of token ids)."""
        if self._closed:
            raise RuntimeError("AsyncLLM has been shut down; create a new AsyncLLM to generate")
        if request_id is not None and str(request_id) in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request")
        eng = self.engine
        group = eng.make_requests(prompt, params, uuid.uuid4().hex if request_id is None else str(request_id))
        for r in group[1:]:
            if r.request_id in self._streams:
                raise ValueError(f"request_id {r.request_id!r} is already in use by a running request")
        self._ensure_loop()
        rid = group[0].request_id
        eng.add_requests(group)
        event = asyncio.Event()             # one for the group: any sample's progress wakes it
        streams = [_Stream(r, event) for r in group]
        for s in streams:
            self._streams[s.req.request_id] = s
        self._wake.set()
        try:
            while True:
                event.clear()
                outs = []
                for i, stream in enumerate(streams):
                    if stream.done:
                        continue
                    try:
                        out = self._take(stream)
                    except Exception as e:          # building this stream's output failed: it alone ends
                        out = self._take_failed(stream, e)
                    if out is not None:
                        stream.done = out.finished
                        outs.append((i, out))
                if not outs:
                    await event.wait()
                    continue
                finished = all(s.done for s in streams)
                yield outs[0][1] if len(streams) == 1 else _group_delta(rid, outs, finished)
                if finished:
                    return
        finally:
            for stream in streams:
                if self._streams.get(stream.req.request_id) is stream:
                    del self._streams[stream.req.request_id]
                if not stream.req.finished:     # the consumer stopped early (break, cancel, close)
                    self._abort_request(stream.req)

    async def chat(self, messages, params: SamplingParams | None = None, request_id: str | None = None, *,
                   chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True):
        """Stream the reply to one conversation (a list of ``{"role", "content"}`` dicts), rendered
        with the tokenizer's chat template (see ``LLM.chat``); deltas as ``generate``."""
        from .chat import conversations_of, render_chat
        convs = conversations_of(messages)
        if len(convs) != 1:
            raise ValueError("AsyncLLM.chat takes one conversation (a list of message dicts); "
                             "start one chat() per conversation")
        ids = render_chat(self.tokenizer, convs[0], chat_template_kwargs, add_generation_prompt)
        async for out in self.generate(ids, params, request_id):
            yield out

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (see ``LLM.get_default_sampling_params``)."""
        return self.engine.generation_defaults.sampling_params()

    async def abort(self, request_id: str) -> bool:
        """Abort a running or queued request; its stream ends with finish_reason "abort".
        Returns False (no error) for an unknown or already finished request."""
        rid = str(request_id)
        stream = self._streams.get(rid)
        if stream is None or stream.req.finished:
            return False
        ok = self._abort_request(stream.req)
        for i in range(1, stream.req.params.n):          # the other samples of an n > 1 request
            sib = self._streams.get(f"{rid}#{i}")
            if sib is not None and sib.event is stream.event and not sib.req.finished:
                self._abort_request(sib.req)
        return ok

    def _abort_request(self, req: Request) -> bool:
        eng = self.engine
        if not eng.is_current(req) or req.finished:
            return False
        ok = eng.abort(req.request_id)
        self._publish([req])
        return ok

    # ---- lifecycle --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the step loop and abort everything still running (their streams end with
        finish_reason "abort"). Call it from the event loop's thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for stream in list(self._streams.values()):
            self._abort_request(stream.req)
        for req in self.engine.requests():
            self._abort_request(req)
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None
        self.engine.drop_inflight()         # its output is never read; nothing runs afterwards
        self.engine.shutdown()              # tensor-parallel workers stop

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._task is not None and not self._task.done():
            if self._loop is loop:
                return
            raise RuntimeError("this AsyncLLM's step loop runs on another event loop; use one AsyncLLM "
                               "per event loop")
        if self._loop is not None and self._loop is not loop:
            # the previous event loop is gone (e.g. a finished asyncio.run): its consumers are too
            for stream in list(self._streams.values()):
                self._abort_request(stream.req)
            self._streams.clear()
        self._loop = loop
        self._wake = asyncio.Event()
        self._task = loop.create_task(self._run(), name="hybrid-engine-step-loop")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The step loop only ends by cancellation (shutdown, or someone cancelled the task) or a
        bug; no stream may hang either way: every request still running or queued ends now. A
        later ``generate`` starts a new loop."""
        if task.cancelled():
            if self._closed:
                return                              # shutdown() already aborted everything
            aborted = self.engine.abort_all("the AsyncLLM step loop task was cancelled")
            if aborted:                             # (an event loop closing cancels an idle loop too)
                logger.warning("the step loop task was cancelled; %d requests aborted", len(aborted))
            self._publish(aborted)
            return
        if task.exception() is None:
            return
        logger.error("step loop died", exc_info=task.exception())
        self._publish(self.engine.fail_all(task.exception()))

    # ---- the step loop ----------------------------------------------------------------------
    async def _run(self) -> None:
        eng = self.engine
        while True:
            if not eng.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                handle, failed = eng.begin_step()          # step N+1 is now in flight
            except Exception as e:                          # the loop machinery itself broke
                logger.exception("step loop failed; failing all requests")
                self._publish(eng.fail_all(e))
                if is_fatal(e):                             # no step can run (a lost TP rank): the loop
                    self._end_all()                         # ends; a later request restarts it and fails
                    return
                continue
            self._publish(failed)
            await asyncio.sleep(0)                          # consumers / arrivals / aborts run here
            if handle is None:
                continue
            try:
                out = await handle.result_async()           # step N's output (the designated wait)
            except asyncio.CancelledError:
                raise
            except Exception as e:                          # reading it failed: its requests fail
                touched = eng.finish_step(handle, error=e)
                if is_fatal(e):
                    self._publish(touched + eng.fail_all(e))
                    self._end_all()
                    return
            else:
                touched = eng.finish_step(handle, out)      # a failing commit fails its step only
            self._publish(touched)

    def _end_all(self) -> None:
        """Wake every stream (the loop is ending on a fatal error: their requests have failed,
        including those a failed launch ended before the error reached the loop)."""
        self._publish([stream.req for stream in list(self._streams.values())])

    def _publish(self, reqs) -> None:
        """Wake the streams of requests that got tokens or finished; forget finished ones in the
        scheduler (the stream keeps the Request, so its id can be reused at once)."""
        eng = self.engine
        for req in reqs:
            stream = self._streams.get(req.request_id)
            if stream is not None and stream.req is req:
                stream.event.set()
            eng.forget(req)

    # ---- outputs ----------------------------------------------------------------------------
    def _take(self, stream: _Stream) -> RequestOutput | None:
        """The delta since the last yield, or None when there is nothing new."""
        req = stream.req
        n = len(req.output_token_ids)
        if n == stream.sent and not req.finished:
            return None
        out = self.engine.make_output(req, delta_from=stream.sent)
        stream.sent = n
        if req.stop_strings is not None:          # the stop-string search owns this request's text
            text = req.stop_strings.visible_text(req.finished, req.output_token_ids)
            out.outputs[0].text, stream.chars_sent = text[stream.chars_sent:], len(text)
        elif self.engine.tokenizer is not None:
            out.outputs[0].text = self._text_delta(stream, n, req.finished)
        return out

    def _take_failed(self, stream: _Stream, error: Exception) -> RequestOutput:
        """``_take`` raised (e.g. detokenisation): end this request alone with an error output."""
        req, msg = stream.req, f"building the output failed: {error!r}"
        logger.error("request %s: %s", req.request_id, msg)
        if not req.finished:
            self._publish(self.engine.fail_requests([req], msg))
        req.error = req.error or msg
        out = error_output(req, req.error, stream.sent)
        stream.sent = len(req.output_token_ids)
        return out

    def _text_delta(self, stream: _Stream, n: int, final: bool) -> str:
        """Text of the new tokens. Decodes a short window with a few tokens of left context (so
        tokenizers that drop a leading space decode correctly) and holds back text that ends in an
        incomplete UTF-8 sequence until more tokens arrive or the request finishes."""
        ids, dec = stream.req.output_token_ids, self.engine.tokenizer.decode
        p, r = stream.prefix_offset, stream.read_offset
        prefix = dec(ids[p:r], skip_special_tokens=True)
        full = dec(ids[p:n], skip_special_tokens=True)
        if (len(full) <= len(prefix) or full.endswith("\ufffd")) and not final:
            return ""
        stream.prefix_offset, stream.read_offset = r, n
        return full[len(prefix):] if full.startswith(prefix) else full[_common_prefix(prefix, full):]


def _group_delta(rid: str, outs: list[tuple[int, RequestOutput]], finished: bool) -> RequestOutput:
    """The deltas of an n > 1 request's samples that progressed, as one RequestOutput under the
    leader's id: ``outputs`` holds those samples only, each with its ``index``."""
    outputs = []
    for i, out in outs:
        c = out.outputs[0]
        c.index = i
        outputs.append(c)
    first = outs[0][1]
    lead = next((o for i, o in outs if i == 0), None)
    return RequestOutput(rid, first.prompt_token_ids, outputs, finished,
                         (lead or first).metrics, next((o.error for _, o in outs if o.error is not None), None),
                         prompt_logprobs=lead.prompt_logprobs if lead is not None else None)


def _common_prefix(a: str, b: str) -> int:
    i = 0
    for x, y in zip(a, b):
        if x != y:
            break
        i += 1
    return i
