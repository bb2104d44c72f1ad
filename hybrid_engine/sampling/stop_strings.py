"""Stop strings: incremental detokenisation of one request's outputs and the search for its stop
strings in the new text.

Only requests that set ``SamplingParams.stop`` carry a ``StopStrings`` (``Request.stop_strings``,
made by ``EngineCore.make_request``); every other request costs the commit nothing. The commit
(``scheduling/scheduler_commit.py``) calls ``push`` after appending each output token, so a stop
string that ends inside a verified run of accepted drafts cuts the output at exactly that token:
later tokens of the run are never appended and the request finishes there (its slot and blocks
are freed by the scheduler's ``finish``).

Incremental: each ``push`` decodes a short window (a few tokens of left context, so byte-level and
sentencepiece tokenizers that drop or merge a leading space decode the same as the whole text)
and appends only the new characters; text that ends in an incomplete UTF-8 sequence is held
back until more tokens arrive. The search covers only the new characters plus ``len(stop) - 1``
characters before them. Output text visible while the request runs holds back the last
``max(len(stop)) - 1`` characters (they might start a stop string); when it finishes on a stop
string the text ends before it (or after it with ``include_stop_str_in_output``).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    """The text of a growing token list, decoded a window at a time."""
    __slots__ = ("decode", "text", "prefix_offset", "read_offset")

    def __init__(self, tokenizer):
        self.decode = tokenizer.decode
        self.text = ""
        self.prefix_offset = 0          # window start (left context for the next decode)
        self.read_offset = 0            # tokens whose text is in self.text

    def push(self, ids: list[int]) -> str:
        """Decode ``ids[read_offset:]`` (all tokens so far are ``ids``); returns the new text ("" if
        it ends in an incomplete character, which is then kept for a later call)."""
        n = len(ids)
        p, r = self.prefix_offset, self.read_offset
        prefix = self.decode(ids[p:r], skip_special_tokens=True)
        full = self.decode(ids[p:n], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = r, n
        new = full[len(prefix):] if full.startswith(prefix) else full[_common_prefix(prefix, full):]
        self.text += new
        return new

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        n, p, r = len(ids), self.prefix_offset, self.read_offset
        if n == r:
            return ""
        prefix = self.decode(ids[p:r], skip_special_tokens=True)
        full = self.decode(ids[p:n], skip_special_tokens=True)
        self.prefix_offset, self.read_offset = r, n
        new = full[len(prefix):] if full.startswith(prefix) else full[_common_prefix(prefix, full):]
        self.text += new
        return new


class StopStrings:
    """One request's stop strings and its output text (``text``: final once ``matched`` is set)."""
    __slots__ = ("stops", "include", "min_tokens", "detok", "matched", "_hold", "_final")

    def __init__(self, tokenizer, stops: tuple[str, ...], include_in_output: bool, min_tokens: int = 0):
        self.stops, self.include, self.min_tokens = stops, include_in_output, min_tokens
        self.detok = IncrementalDetokenizer(tokenizer)
        self.matched: str | None = None     # the stop string that ended the request
        self._hold = max(len(s) for s in stops) - 1
        self._final: str | None = None      # the cut text once matched

    def push(self, ids: list[int]) -> bool:
        """``ids`` (all output tokens) got one more token: True when a stop string now appears in
        the text (searched from ``min_tokens`` outputs on); the text is then cut there."""
        before = len(self.detok.text)
        new = self.detok.push(ids)
        if not new or len(ids) < self.min_tokens:
            return False
        text = self.detok.text
        best = None                         # the earliest stop string ending in the new text
        for s in self.stops:
            i = text.find(s, max(0, before - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.matched = s
        self._final = text[:i + len(s)] if self.include else text[:i]
        return True

    def visible_text(self, finished: bool, ids: list[int]) -> str:
        """The output text a user may see now: cut at the stop string after a match; when finished
        otherwise, everything; while running, all but the held-back tail."""
        if self._final is not None:
            return self._final
        if finished:
            self.detok.flush(ids)
            return self.detok.text
        text = self.detok.text
        return text[:max(0, len(text) - self._hold)]


def _common_prefix(a: str, b: str) -> int:
    i = 0
    for x, y in zip(a, b):
        if x != y:
            break
        i += 1
    return i
