"""Request bodies of the OpenAI-compatible API (pydantic models), the OpenAI-shaped error, and the
mapping of a request's sampling fields to ``SamplingParams``.

Supported sampling fields: max_tokens (chat: also max_completion_tokens), temperature, top_p, stop,
presence_penalty, frequency_penalty, logit_bias, and the extensions top_k, min_p, seed,
stop_token_ids, ignore_eos, include_stop_str_in_output, min_tokens, repetition_penalty, bad_words.
logprobs (completions: an int; chat: logprobs=true with top_logprobs). Fields of the OpenAI API that
the engine does not implement yet (best_of, suffix, tools, response_format) are accepted by the parser so that a request setting them gets a
400 naming the field instead of being silently served without it. Unknown fields are ignored.
"""
from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ..sampling_params import SamplingParams


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None) -> ApiError:
    return ApiError(400, message, param=param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = 1.0                 # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    top_k: int = -1                          # extension; -1 or 0 = off
    min_p: float = 0.0                       # extension
    seed: int | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False                 # extension
    include_stop_str_in_output: bool = False # extension
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0          # extension
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0                      # extension
    bad_words: list[str] | None = None       # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False           # extension: prompt_token_ids / token_ids in the reply
    user: str | None = None                  # accepted, unused
    # OpenAI fields the engine does not implement yet: a non-default value is a 400 naming the field
    n: int = 1

    def unsupported(self) -> dict[str, bool]:
        """field -> whether the request sets it to something the engine cannot do yet."""
        return {}

    def check_supported(self) -> None:
        for name, bad in self.unsupported().items():
            if bad:
                raise bad_request(f"'{name}'={getattr(self, name)!r} is not supported by this server yet "
                                  f"(leave it unset)", name)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs of this request (None: no logprobs)."""
        return None

    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs (completions with echo and logprobs)."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams; its validation errors become a 400 naming the field."""
        try:
            return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                                  top_k=-1 if self.top_k == 0 else self.top_k, min_p=self.min_p, seed=self.seed,
                                  stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                                  stop=self.stop, include_stop_str_in_output=self.include_stop_str_in_output,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, logit_bias=self._logit_bias(),
                                  min_tokens=self.min_tokens, bad_words=self.bad_words,
                                  logprobs=self.num_logprobs(), prompt_logprobs=self.num_prompt_logprobs(), n=self.n)
        except (ValueError, TypeError) as e:
            m = re.match(r"SamplingParams\.(\w+)=", str(e))
            raise bad_request(str(e), m.group(1) if m else None) from None


    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias has token ids as JSON object keys (strings)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, bias in self.logit_bias.items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise bad_request(f"logit_bias key {key!r} is not a token id (an integer)", "logit_bias") from None
        return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16              # OpenAI's default for completions (also for an explicit null)
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> dict[str, bool]:
        return {**super().unsupported(), "best_of": self.best_of not in (None, 1),
                "suffix": self.suffix is not None}

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def single_prompt(self) -> str | list[int]:
        """The one prompt (a batch of one is unwrapped); a batch of several is a 400."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request(f"'prompt' holds {len(p)} prompts; this server takes one prompt per request",
                                  "prompt")
            p = p[0]
        if not p:
            raise bad_request("'prompt' is empty", "prompt")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")     # name, tool_call_id ... reach the template as given
    role: str
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True          # extension
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: Any = None
    response_format: dict | None = None

    def unsupported(self) -> dict[str, bool]:
        text_format = self.response_format is None or self.response_format.get("type") == "text"
        return {**super().unsupported(), "tools": bool(self.tools), "tool_choice": self.tool_choice not in (None, "none"),
                "response_format": not text_format}

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if not self.logprobs:
            return None
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise bad_request(f"'top_logprobs'={self.top_logprobs!r} is invalid: allowed an integer in [0, 20]",
                              "top_logprobs")
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict]:
        """Messages as plain dicts for the chat template; content parts must be text."""
        out = []
        for i, m in enumerate(self.messages):
            d = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(f"content part type {part.type!r} is not supported (text only)",
                                          f"messages.{i}.content.{j}.type")
                d["content"] = "".join(part.text for part in m.content)
            out.append(d)
        return out
