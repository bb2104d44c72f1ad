"""``POST /v1/completions``: one prompt (text or token ids) -> one choice, whole or streamed.

``echo``: the choice's text starts with the prompt (the first streamed chunk carries it); with
``logprobs`` its tokens and logprobs come first too (prompt logprobs, None for the first token):
the loglikelihood request of evaluation harnesses."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .logprobs import completion_logprobs
from .protocol import CompletionRequest
from .serving import Run, ServerState, until_disconnect
from .sse import error_event, sse_event, DONE


def _choice(req: CompletionRequest, run: Run, text: str, finish_reason: str | None, token_ids=None,
            logprobs=None, offset: int = 0, echo: bool = False, index: int = 0, stop_reason=None) -> dict:
    lp = None
    if echo:                            # the prompt first: its text, tokens and prompt logprobs
        text = _prompt_text(run) + text
    if req.logprobs is not None:
        ids, entries = list(token_ids), list(logprobs or ())
        if echo:
            ids, entries = list(run.prompt_token_ids) + ids, list(run.prompt_logprobs) + entries
        lp = completion_logprobs(run.state.llm.tokenizer, ids, entries, req.logprobs, offset)
    c = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason,
         "stop_reason": stop_reason if finish_reason else None}
    if req.return_token_ids:
        c["token_ids"] = token_ids
        c["prompt_token_ids"] = run.prompt_token_ids
    return c


def _prompt_text(run: Run) -> str:
    tok = run.state.llm.tokenizer
    return tok.decode(run.prompt_token_ids, skip_special_tokens=True) if tok is not None else ""


async def create_completion(state: ServerState, req: CompletionRequest, http: Request):
    state.check_model(req.model)
    req.check_supported()
    prompt = req.single_prompt()
    params = req.sampling_params(16 if req.max_tokens is None else req.max_tokens)
    created = int(time.time())

    def body(run: Run, choices: list[dict], usage: dict | None) -> dict:
        return {"id": run.request_id, "object": "text_completion", "created": created,
                "model": state.config.model_name, "choices": choices, "usage": usage}

    if not req.stream:
        async def whole():
            run = await state.admit_and_start(prompt, params, "prompt", "cmpl")
            texts = await run.collect()
            return body(run, [_choice(req, run, text, s.finish_reason, list(s.token_ids), s.logprobs, echo=req.echo,
                                      index=i, stop_reason=s.stop_reason)
                              for i, (text, s) in enumerate(zip(texts, run.samples))], run.usage)
        return JSONResponse(await until_disconnect(http, whole()))

    run = await until_disconnect(http, state.admit_and_start(prompt, params, "prompt", "cmpl"))

    async def events():
        offsets, echo = [0] * params.n, [req.echo] * params.n
        async for out in run.outputs(http):
            for c in out.outputs:
                i = c.index
                finish = c.finish_reason if c.finish_reason is not None and out.error is None else None
                if c.token_ids or c.text or finish or echo[i]:
                    choice = _choice(req, run, c.text or "", finish, list(c.token_ids), c.logprobs, offsets[i],
                                     echo[i], i, c.stop_reason)
                    yield sse_event(body(run, [choice], None))
                    offsets[i] += len(choice["text"])
                    echo[i] = False
        if run.last.error is not None:
            yield error_event(run.error())
        elif req.include_usage:
            yield sse_event(body(run, [], run.usage))
        yield DONE
    return StreamingResponse(events(), media_type="text/event-stream")
