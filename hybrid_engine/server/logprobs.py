"""The OpenAI shapes of token logprobs (``SamplingParams.logprobs``; values from sampling/logprobs.py:
the sampled token's entry first, then the top alternatives). Tokens are shown as their decoded
text; ``-inf`` (a banned token) becomes -9999.0, since JSON has no infinity."""
from __future__ import annotations

import math


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _text(tok, token_id: int) -> str:
    return tok.decode([token_id]) if tok is not None else str(token_id)


def completion_logprobs(tok, token_ids: list[int], entries: list[dict], n: int, offset: int = 0) -> dict:
    """``choices[i].logprobs`` of /v1/completions: tokens, token_logprobs, top_logprobs (the n best
    plus the sampled token), text_offset (characters from the start of the choice's text + offset)."""
    tokens, lps, tops, offsets = [], [], [], []
    for t, e in zip(token_ids, entries):
        s = _text(tok, t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:                       # the first prompt token (echo): nothing predicts it
            lps.append(None)
            tops.append(None)
            continue
        lps.append(_finite(e[t]))
        best = sorted(e.items(), key=lambda kv: -kv[1])[:n]
        top = {_text(tok, i): _finite(v) for i, v in best}
        top.setdefault(s, _finite(e[t]))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tok, token_ids: list[int], entries: list[dict], n: int) -> dict:
    """``choices[i].logprobs`` of /v1/chat/completions: {"content": [{token, logprob, bytes,
    top_logprobs: the n best}]}."""
    def item(i: int, v: float) -> dict:
        s = _text(tok, i)
        return {"token": s, "logprob": _finite(v), "bytes": list(s.encode("utf-8"))}
    content = []
    for t, e in zip(token_ids, entries):
        best = sorted(e.items(), key=lambda kv: -kv[1])[:n]
        content.append({**item(t, e[t]), "top_logprobs": [item(i, v) for i, v in best]})
    return {"content": content}
