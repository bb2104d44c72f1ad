"""Chat prompts: a conversation rendered with the tokenizer's own chat template.

``render_chat`` calls ``tokenizer.apply_chat_template`` (the Jinja template shipped with the model in
tokenizer_config.json or chat_template.jinja) to text, then encodes that text without adding
special tokens (the template writes BOS and role markers itself). ``chat_template_kwargs`` are
passed to the template, e.g. ``{"enable_thinking": False}`` for the Nemotron 3 reasoning switch
(Nemotron Nano v2 switches with a ``/no_think`` system message instead: no kwarg needed).
"""
from __future__ import annotations

from typing import Any

Conversation = list[dict[str, Any]]


def is_conversation(obj) -> bool:
    """A single conversation (list of message dicts), as opposed to a list of conversations."""
    return isinstance(obj, (list, tuple)) and all(isinstance(m, dict) for m in obj)


def conversations_of(messages) -> list[Conversation]:
    """One conversation or a list of them -> list of conversations (ValueError otherwise)."""
    if is_conversation(messages) and messages:
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and messages and all(is_conversation(c) and c for c in messages):
        return [list(c) for c in messages]
    raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts, or a "
                     "list of such conversations")


def _check_messages(conv: Conversation) -> None:
    for i, m in enumerate(conv):
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] needs a 'role' string (system, user, assistant, ...), got {m!r}")
        if "content" in m and not isinstance(m["content"], (str, list, type(None))):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(m['content']).__name__}")


def render_chat(tokenizer, conv: Conversation, chat_template_kwargs: dict | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of ``conv`` rendered with the tokenizer's chat template."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, and the model folder has none")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model's tokenizer has no chat template (tokenizer_config.json "
                         "'chat_template' or chat_template.jinja); use generate() with a plain prompt")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict or None, got "
                         f"{type(chat_template_kwargs).__name__}")
    _check_messages(conv)
    try:
        text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(chat_template_kwargs or {}))
    except Exception as e:           # jinja errors: a message the template rejects
        raise ValueError(f"the chat template could not render these messages: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))
