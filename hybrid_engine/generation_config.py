"""The model's own generation defaults, read from ``generation_config.json`` in the model folder.

Read fields (all optional; others are ignored):
  eos_token_id      int or list of ints: generation stops on any of them (added to config.json's);
  temperature, top_p, top_k, min_p, do_sample (false means greedy: temperature 0);
  max_new_tokens    default ``max_tokens``;
  max_length        prompt + output cap, used for ``max_tokens`` when max_new_tokens is absent.

How they combine with the user's ``SamplingParams`` (as vLLM does): a request sent with
``params=None`` gets ``LLM.get_default_sampling_params()``, i.e. these defaults over
``SamplingParams()``'s. A request sent with a ``SamplingParams`` uses it as given: every sampling
field there is the user's. To start from the model's defaults and change one field use
``dataclasses.replace(llm.get_default_sampling_params(), max_tokens=64)``. The EOS ids apply to
every request either way (``ignore_eos=True`` turns them off).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .sampling_params import SamplingParams

FILE = "generation_config.json"


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_new_tokens: int | None = None
    max_length: int | None = None

    def sampling_params(self, prompt_len: int = 0) -> SamplingParams:
        """SamplingParams() with these defaults applied (max_length minus the prompt, at least 1,
        when max_new_tokens is absent)."""
        kw = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p")
              if getattr(self, k) is not None}
        if self.max_new_tokens is not None:
            kw["max_tokens"] = self.max_new_tokens
        elif self.max_length is not None:
            kw["max_tokens"] = max(1, self.max_length - prompt_len)
        return dataclasses.replace(SamplingParams(), **kw) if kw else SamplingParams()


def _bad(path, field, value, allowed):
    raise ValueError(f"{path}: {field}={value!r} is invalid; allowed: {allowed}")


def _int(path, d, field, lo):
    v = d.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        _bad(path, field, v, f"an integer >= {lo}")
    return v


def _float(path, d, field, ok, allowed):
    v = d.get(field)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not ok(v):
        _bad(path, field, v, allowed)
    return float(v)


def read_generation_config(model_dir, vocab_size: int) -> GenerationDefaults:
    """Parse ``model_dir/generation_config.json`` (absent file: no defaults). ValueError naming the
    file and the field for invalid JSON, wrong types, or an EOS id outside [0, vocab_size)."""
    path = Path(model_dir) / FILE
    if not path.is_file():
        return GenerationDefaults()
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(d).__name__}")
    eos = d.get("eos_token_id")
    eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
    for e in eos:
        if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vocab_size:
            _bad(path, "eos_token_id", d.get("eos_token_id"),
                 f"an id or a list of ids in the vocabulary [0, {vocab_size})")
    temperature = _float(path, d, "temperature", lambda v: v >= 0, "a number >= 0")
    if d.get("do_sample") is False:
        temperature = 0.0                  # transformers: do_sample=false is greedy whatever temperature says
    elif d.get("do_sample") not in (None, True):
        _bad(path, "do_sample", d.get("do_sample"), "true or false")
    top_k = _int(path, d, "top_k", 0)
    return GenerationDefaults(
        eos_token_ids=tuple(dict.fromkeys(eos)), temperature=temperature,
        top_p=_float(path, d, "top_p", lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=None if top_k is None else (-1 if top_k == 0 else top_k),   # 0 = off in transformers
        min_p=_float(path, d, "min_p", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        max_new_tokens=_int(path, d, "max_new_tokens", 1), max_length=_int(path, d, "max_length", 2))
