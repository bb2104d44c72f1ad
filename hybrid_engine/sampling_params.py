"""User-facing sampling parameters, validated before anything is queued.

Every field is checked against what the step can serve: values are stored in int64 / float32
per-row arrays and computed on in float32 by the sampler, so integers must fit int64, and
temperatures stay in a range where ``logits / temperature`` is exact and finite (see
``TEMPERATURE_RANGE``). Types are strict: ``True`` is not a token id, ``1.7`` is not silently
truncated, ``"0.5"`` is not a temperature. A wrong type raises ``TypeError``, a value out of range
``ValueError``; both name the field and what is allowed. Checks that need the model (token ids
within the vocabulary) are done by ``EngineCore.make_request``.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# temperature: 0 (greedy) or within this range. The sampler divides float32 logits by it; with
# |logits| well below 1e4 (any sane model) the result stays below 1e7, where float32 softmax and
# Gumbel-max are exact and finite. Below the range the division overflows (1e-45 is a float32
# denormal, 1e-46 rounds to 0 = greedy), above it every distribution is uniform to float32.
TEMPERATURE_RANGE = (1e-3, 1e3)
INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20
MAX_BAD_WORDS = 32                # strings (each may give two token spellings: with and without a space)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and type(x).__name__ != "bool_"


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and type(x).__name__ != "bool_"


@dataclass(frozen=True)
class SamplingParams:
    """max_tokens: int in [1, 2**63); generation also stops at max_model_len.
    temperature: 0 (greedy) or a finite number in ``TEMPERATURE_RANGE``.
    top_k: -1 (off) or an int in [1, 2**63); values above the vocabulary size keep every token.
    top_p: a number in (0, 1]; min_p: a number in [0, 1].
    seed: None (drawn from the engine's seed) or an int in [0, 2**63).
    stop_token_ids: a list/tuple of int token ids (checked against the vocabulary at submission).
    ignore_eos: bool. n: samples per prompt, sharing one prefill (an int in [1, 1024], at most the
    engine's max_num_seqs); with a seed, sample i uses seed + i.
    stop: a str or a list/tuple of non-empty strs; generation stops when the output text contains
    one (needs a tokenizer). include_stop_str_in_output: bool, keep the stop string in the text.
    min_tokens: int in [0, max_tokens]: stop ids and EOS are banned (and stop strings not searched)
    until this many tokens were generated.
    presence_penalty, frequency_penalty: numbers in [-2, 2]; repetition_penalty: a number in (0, 100]
    (1 = off); definitions in sampling/logits_processing.py.
    logit_bias: {token id: bias in [-100, 100]} added to the logits (stored as sorted (id, bias) pairs).
    bad_words: a list of non-empty strs (at most 32, each at most 8 tokens; needs a tokenizer); the
    last token of a word is banned where the output ends with its other tokens.
    logprobs: None or an int in [0, 20]: each output token's logprob and the top ``logprobs``
    alternatives (sampling/logprobs.py).
    prompt_logprobs: None or an int in [0, 20]: each prompt token's logprob given the tokens before
    it (None for the first) and the top alternatives (sampling/prompt_logprobs.py)."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop", _str_tuple("stop", self.stop))
        object.__setattr__(self, "bad_words", _str_tuple("bad_words", self.bad_words))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        stop = self.stop_token_ids
        if stop is None:
            stop = ()
        if isinstance(stop, (str, bytes)) or not isinstance(stop, (list, tuple)):
            raise TypeError(f"SamplingParams.stop_token_ids={stop!r} is invalid: allowed a list or tuple "
                            f"of int token ids, got {type(stop).__name__}")
        for t in stop:
            if not _is_int(t):
                raise TypeError(f"SamplingParams.stop_token_ids contains {t!r} ({type(t).__name__}): "
                                f"allowed only int token ids (no bools, no floats)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        self.validate()
        # numpy scalars become Python numbers (numpy int64 arithmetic would wrap around silently)
        for name in ("max_tokens", "top_k", "n", "min_tokens") + (("seed",) if self.seed is not None else ()):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    def validate(self) -> None:
        def bad(name, allowed, exc=ValueError):
            v = getattr(self, name)
            r = repr(v)
            r = r if len(r) <= 40 else r[:20] + "..." + r[-8:]
            raise exc(f"SamplingParams.{name}={r} ({type(v).__name__}) is invalid: allowed {allowed}")

        def integer(name, lo, hi, allowed):
            v = getattr(self, name)
            if not _is_int(v):
                bad(name, allowed, TypeError)
            if not lo <= v <= hi:
                bad(name, allowed)

        def real(name, ok, allowed):
            v = getattr(self, name)
            if not _is_real(v):
                bad(name, allowed, TypeError)
            try:
                f = float(v)
            except OverflowError:           # an int beyond float range, e.g. 10**400
                f = math.inf
            if not (math.isfinite(f) and ok(f)):
                bad(name, allowed)

        integer("max_tokens", 1, INT64_MAX, "an integer in [1, 2**63)")
        lo, hi = TEMPERATURE_RANGE
        real("temperature", lambda t: t == 0 or lo <= t <= hi,
             f"0 (greedy) or a finite number in [{lo:g}, {hi:g}]")
        t = self.top_k
        if not _is_int(t):
            bad("top_k", "-1 (off) or an integer in [1, 2**63)", TypeError)
        if not (t == -1 or 1 <= t <= INT64_MAX):
            bad("top_k", "-1 (off) or an integer in [1, 2**63) (values above the vocabulary keep every token)")
        real("top_p", lambda p: 0 < p <= 1, "a number in (0, 1]")
        real("min_p", lambda p: 0 <= p <= 1, "a number in [0, 1]")
        integer("n", 1, 1024, "an integer in [1, 1024] (at most max_num_seqs of the engine)")
        if self.seed is not None:
            integer("seed", 0, INT64_MAX, "None or an integer in [0, 2**63)")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "True or False", TypeError)
        if not isinstance(self.stop_token_ids, tuple) or not all(
                _is_int(x) and 0 <= x <= INT64_MAX for x in self.stop_token_ids):
            bad("stop_token_ids", "a list or tuple of int token ids in [0, 2**63) (and within the vocabulary)")

        if not isinstance(self.include_stop_str_in_output, bool):
            bad("include_stop_str_in_output", "True or False", TypeError)
        integer("min_tokens", 0, self.max_tokens, f"an integer in [0, max_tokens={self.max_tokens}]")
        real("presence_penalty", lambda x: -2 <= x <= 2, "a number in [-2, 2]")
        real("frequency_penalty", lambda x: -2 <= x <= 2, "a number in [-2, 2]")
        real("repetition_penalty", lambda x: 0 < x <= 100, "a number in (0, 100] (1 = off)")
        if len(self.bad_words) > MAX_BAD_WORDS:
            bad("bad_words", f"at most {MAX_BAD_WORDS} words")
        if self.logprobs is not None:
            integer("logprobs", 0, MAX_LOGPROBS, f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None:
            integer("prompt_logprobs", 0, MAX_LOGPROBS, f"None or an integer in [0, {MAX_LOGPROBS}]")
        for t, b in self.logit_bias:
            if not (0 <= t <= INT64_MAX and math.isfinite(b) and -100 <= b <= 100):
                bad("logit_bias", "a dict {token id >= 0: bias in [-100, 100]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether the request's logits are processed on the device (sampling/logits_processing.py)."""
        return bool(self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1 or self.logit_bias or self.bad_words)


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """logit_bias as given (a dict, or pairs) -> sorted (int id, float bias) pairs; types checked."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, b) for k, b in items]
    except (TypeError, ValueError):
        raise TypeError(f"SamplingParams.logit_bias={value!r} is invalid: allowed a dict "
                        f"{{token id: bias}}") from None
    for k, b in pairs:
        if not _is_int(k) or not _is_real(b):
            raise TypeError(f"SamplingParams.logit_bias has {k!r}: {b!r}: allowed int token ids mapped to "
                            f"numbers")
    return tuple(sorted((int(k), float(b)) for k, b in pairs))


def _str_tuple(name: str, value) -> tuple[str, ...]:
    """A str or a list/tuple of non-empty strs -> a tuple (None and [] -> ())."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise TypeError(f"SamplingParams.{name}={value!r} is invalid: allowed a str or a list of strs")
    if any(not s for s in value):
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: allowed non-empty strings only")
    return tuple(value)


def check_stop_ids(params: SamplingParams, vocab_size: int) -> None:
    """The model-dependent part of validation: every stop id and logit_bias key is a token of the
    vocabulary."""
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.stop_token_ids contains {bad[0]}, outside the vocabulary "
                         f"[0, {vocab_size}): allowed token ids of this model")
    bad = [t for t, _ in params.logit_bias if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"SamplingParams.logit_bias has token id {bad[0]}, outside the vocabulary "
                         f"[0, {vocab_size}): allowed token ids of this model")
