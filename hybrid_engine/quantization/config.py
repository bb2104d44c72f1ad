"""Which quantization a model runs with: parsed from the checkpoint, or asked for at ``LLM(...)``.

``QuantConfig`` (frozen) is the one description every other piece reads:
- ``method``: ``"fp8"`` (float8_e4m3fn weights, one float32 scale per tensor or per output
  channel) or ``"nvfp4"`` (FP4 e2m1 weights packed two per uint8, a float8_e4m3fn scale per 16
  input elements and a float32 global ``weight_scale_2``; weight-only on Hopper);
- ``source``: ``"checkpoint"`` (weights are stored quantized, in NVIDIA ModelOpt's published layout)
  or ``"online"`` (a 16/32-bit checkpoint quantized while it is loaded);
- ``exclude_modules``: module names / fnmatch patterns left unquantized (ModelOpt's list).

Published form (config.json ``quantization_config``, or ``hf_quant_config.json``'s
``quantization`` block): ``{"quant_method": "modelopt", "quant_algo": "FP8" | "NVFP4",
"kv_cache_quant_algo": ..., "exclude_modules": [...], "group_size": 16 (NVFP4)}``. Every other
method or algorithm is a ValueError naming it and listing what is implemented.
"""
from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

METHODS = ("fp8", "nvfp4")
SOURCES = ("checkpoint", "online")
# ModelOpt quant_algo -> our method
_MODELOPT_ALGOS = {"FP8": "fp8", "NVFP4": "nvfp4"}
# LLM(quantization=...) spellings -> method
_USER_NAMES = {"fp8": "fp8", "modelopt": None, "modelopt_fp8": "fp8", "nvfp4": "nvfp4",
               "modelopt_fp4": "nvfp4", "fp4": "nvfp4"}
NVFP4_GROUP = 16
HF_QUANT_FILE = "hf_quant_config.json"
# modules an online quantization leaves alone unless asked (vLLM does the same for the lm_head)
DEFAULT_ONLINE_EXCLUDE = ("lm_head",)
MIN_CUDA_CAPABILITY = (8, 9)       # float8_e4m3fn conversions (Ada, Hopper and later)


@dataclass(frozen=True)
class QuantConfig:
    method: str                                  # "fp8" | "nvfp4"
    source: str                                  # "checkpoint" | "online"
    exclude_modules: tuple[str, ...] = ()
    kv_cache_quant_algo: str | None = None       # the checkpoint's KV-cache format ("FP8": k/v scales stored)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"quantization method must be one of {', '.join(map(repr, METHODS))}, "
                             f"got {self.method!r}")
        if self.source not in SOURCES:
            raise ValueError(f"quantization source must be one of {SOURCES}, got {self.source!r}")

    def excluded(self, module_name: str) -> bool:
        """True when ``module_name`` (model naming, ``backbone.*``) matches an excluded name or
        pattern; patterns may use the published ``backbone.`` / ``model.`` prefix or none."""
        bare = module_name[len("backbone."):] if module_name.startswith("backbone.") else module_name
        names = (module_name, bare, "model." + bare)
        return any(fnmatch.fnmatchcase(n, p) for p in self.exclude_modules for n in names)

    def to_published(self) -> dict:
        """The ``quantization_config`` block a ModelOpt export writes into config.json."""
        d = {"quant_method": "modelopt", "quant_algo": {"fp8": "FP8", "nvfp4": "NVFP4"}[self.method],
             "kv_cache_quant_algo": self.kv_cache_quant_algo, "exclude_modules": list(self.exclude_modules)}
        if self.method == "nvfp4":
            d["group_size"] = NVFP4_GROUP
        return d


def parse_checkpoint_quantization(d: dict) -> QuantConfig | None:
    """config.json dict -> QuantConfig(source="checkpoint") or None; ValueError for anything that
    is not a ModelOpt FP8 / NVFP4 block."""
    for key in ("quantization_config", "compression_config"):
        q = d.get(key)
        if q is None:
            continue
        if not isinstance(q, dict):
            raise ValueError(f"config.json {key} must be an object, got {q!r}")
        if isinstance(q.get("quantization"), dict):        # hf_quant_config.json nesting
            q = {**q["quantization"], "quant_method": q.get("quant_method", "modelopt")}
        method = q.get("quant_method", "modelopt" if "quant_algo" in q else None)
        algo = q.get("quant_algo")
        if method != "modelopt" or algo not in _MODELOPT_ALGOS:
            raise ValueError(
                f"config.json {key} (quant_method {method!r}, quant_algo {algo!r}) is not supported: "
                "implemented are quant_method 'modelopt' with quant_algo 'FP8' (per-tensor scales) or "
                "'NVFP4' (weight-only); or load the BF16 release, optionally with quantization='fp8'")
        group = q.get("group_size", NVFP4_GROUP)
        if algo == "NVFP4" and group != NVFP4_GROUP:
            raise ValueError(f"config.json {key}: NVFP4 group_size must be {NVFP4_GROUP}, got {group!r}")
        exclude = q.get("exclude_modules", q.get("ignore")) or []
        if not isinstance(exclude, list) or not all(isinstance(x, str) for x in exclude):
            raise ValueError(f"config.json {key}.exclude_modules must be a list of module names, got {exclude!r}")
        kv = q.get("kv_cache_quant_algo")
        return QuantConfig(method=_MODELOPT_ALGOS[algo], source="checkpoint", exclude_modules=tuple(exclude),
                           kv_cache_quant_algo=kv if isinstance(kv, str) else None)
    return None


def merge_hf_quant_config(d: dict, folder: Path) -> dict:
    """config.json dict + the folder's hf_quant_config.json (when config.json has no
    quantization_config) -> the dict to parse."""
    f = folder / HF_QUANT_FILE
    if "quantization_config" in d or "compression_config" in d or not f.is_file():
        return d
    try:
        hq = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(hq, dict) or not isinstance(hq.get("quantization"), dict):
        raise ValueError(f"{f} must hold an object with a 'quantization' object (ModelOpt's layout)")
    return {**d, "quantization_config": {**hq["quantization"], "quant_method": "modelopt"}}


def resolve_quantization(name, stored: QuantConfig | None, device: torch.device,
                         dtype: torch.dtype) -> QuantConfig | None:
    """``LLM(quantization=name)`` and the checkpoint's own quantization -> the one the engine runs.

    None: the checkpoint's (or none). A name matching the checkpoint's method: the checkpoint's.
    A name on an unquantized checkpoint: quantize at load ("online"). A different method than
    the stored one is an error (no re-quantization of quantized weights)."""
    allowed = "None, " + ", ".join(map(repr, _USER_NAMES))
    if name is not None and (not isinstance(name, str) or name.lower() not in _USER_NAMES):
        raise ValueError(f"quantization must be {allowed}, got {name!r}")
    want = _USER_NAMES[name.lower()] if name is not None else None
    if name is not None and want is None and stored is None:
        raise ValueError(f"quantization={name!r} reads a ModelOpt checkpoint, but this checkpoint's "
                         "config.json has no quantization_config; use quantization='fp8' to "
                         "quantize it at load")
    if stored is not None:
        if want is not None and want != stored.method:
            raise ValueError(f"quantization={name!r} but the checkpoint is stored in {stored.method!r}; "
                             f"pass quantization=None or {stored.method!r}")
        q = stored
    elif want is not None:
        q = QuantConfig(method=want, source="online", exclude_modules=DEFAULT_ONLINE_EXCLUDE)
    else:
        return None
    check_supported(q, device, dtype)
    return q


def check_supported(q: QuantConfig, device: torch.device, dtype: torch.dtype) -> None:
    """ValueError when ``q`` cannot run on ``device`` (checked while LLM(...) is built)."""
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < MIN_CUDA_CAPABILITY:
            raise ValueError(f"quantization {q.method!r} needs a GPU with float8 support (compute "
                             f"capability >= {MIN_CUDA_CAPABILITY[0]}.{MIN_CUDA_CAPABILITY[1]}, Ada or "
                             f"Hopper); {torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantization {q.method!r} computes in bfloat16, float16 or float32, got {dtype}")
