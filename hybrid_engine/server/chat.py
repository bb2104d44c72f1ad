"""``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template
(``tokenizer.apply_chat_template``, ``chat_template_kwargs`` passed through), one choice, whole or
streamed.

``DEFAULT_MODEL_TEMPLATE`` is the template of the embedded default model, whose tokenizer ships
none (the CLI passes it when no model folder is given); any other model uses its tokenizer's
template unless ``--chat-template`` overrides it.
"""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest, bad_request
from .serving import Run, ServerState, until_disconnect
from .sse import DONE, error_event, sse_event

DEFAULT_MODEL_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# arguments of apply_chat_template the server sets itself; chat_template_kwargs may not override them
_RESERVED = ("conversation", "chat_template", "add_generation_prompt", "tokenize", "return_dict")


def render_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    """Token ids of the rendered conversation (400 naming ``messages`` when it cannot be rendered)."""
    tok = state.llm.tokenizer
    if tok is None:
        raise bad_request("this model has no tokenizer, so chat is unavailable; use /v1/completions with "
                          "token ids", "messages")
    template = state.config.chat_template
    if template is None and not getattr(tok, "chat_template", None):
        raise bad_request("the model's tokenizer has no chat template; start the server with --chat-template",
                          "messages")
    extra = dict(req.chat_template_kwargs or {})
    clash = [k for k in _RESERVED if k in extra]
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", "chat_template_kwargs")
    messages = req.template_messages()
    try:
        text = tok.apply_chat_template(messages, chat_template=template, tokenize=False,
                                       add_generation_prompt=req.add_generation_prompt, **extra)
    except (TypeError, ValueError) as e:
        raise bad_request(f"the chat template could not render the messages: {e}", "messages") from None
    except Exception as e:                       # jinja2 errors (TemplateError, UndefinedError...)
        raise bad_request(f"the chat template failed: {type(e).__name__}: {e}", "messages") from None
    ids = list(tok.encode(text, add_special_tokens=False))
    if not ids:
        raise bad_request("the rendered conversation is empty", "messages")
    return ids


def _max_tokens(state: ServerState, req: ChatCompletionRequest, prompt_len: int) -> int:
    """The request's limit, else all the room left in max_model_len."""
    for name in ("max_completion_tokens", "max_tokens"):
        if getattr(req, name) is not None:
            return getattr(req, name)
    room = state.max_model_len - prompt_len
    if room < 1:
        raise bad_request(f"the conversation has {prompt_len} tokens; max_model_len={state.max_model_len} leaves "
                          "no room to generate", "messages")
    return room


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, http: Request):
    state.check_model(req.model)
    req.check_supported()
    ids = render_prompt(state, req)
    params = req.sampling_params(_max_tokens(state, req, len(ids)))
    created = int(time.time())

    def body(run: Run, obj: str, choices: list[dict], usage: dict | None) -> dict:
        return {"id": run.request_id, "object": obj, "created": created, "model": state.config.model_name,
                "choices": choices, "usage": usage}

    def logprobs(token_ids, lps) -> dict | None:
        if params.logprobs is None:
            return None
        return chat_logprobs(state.llm.tokenizer, list(token_ids), list(lps or ()), params.logprobs)

    def extras(run: Run, token_ids) -> dict:
        return {"token_ids": list(token_ids), "prompt_token_ids": run.prompt_token_ids} if req.return_token_ids else {}

    if not req.stream:
        async def whole():
            run = await state.admit_and_start(ids, params, "messages", "chatcmpl")
            texts = await run.collect()
            choices = [{"index": i, "message": {"role": "assistant", "content": text},
                        "logprobs": logprobs(s.token_ids, s.logprobs),
                        "finish_reason": s.finish_reason, "stop_reason": s.stop_reason, **extras(run, s.token_ids)}
                       for i, (text, s) in enumerate(zip(texts, run.samples))]
            return body(run, "chat.completion", choices, run.usage)
        return JSONResponse(await until_disconnect(http, whole()))

    run = await until_disconnect(http, state.admit_and_start(ids, params, "messages", "chatcmpl"))

    def chunk(delta: dict, finish: str | None, token_ids=(), lps=None, index: int = 0) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs(token_ids, lps) if token_ids else None,
                  "finish_reason": finish, **extras(run, token_ids)}
        return sse_event(body(run, "chat.completion.chunk", [choice], None))

    async def events():
        for i in range(params.n):
            yield chunk({"role": "assistant", "content": ""}, None, index=i)
        async for out in run.outputs(http):
            for c in out.outputs:
                finish = c.finish_reason if c.finish_reason is not None and out.error is None else None
                if c.token_ids or c.text or finish:
                    yield chunk({"content": c.text or ""}, finish, c.token_ids, c.logprobs, c.index)
        if run.last.error is not None:
            yield error_event(run.error())
        elif req.include_usage:
            yield sse_event(body(run, "chat.completion.chunk", [], run.usage))
        yield DONE
    return StreamingResponse(events(), media_type="text/event-stream")
