"""The device and dtype a user names (``LLM(device=..., dtype=...)``), resolved: "auto" and the
accepted spellings; every error a ``ValueError`` saying what is allowed. ``config.EngineConfig``
resolves through these (and ``hybrid_engine.config`` re-exports them)."""
from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


def _dtype_from_name(name: str) -> torch.dtype | None:
    name = name.removeprefix("torch.")
    return _DTYPES.get(_DTYPE_ALIASES.get(name, name))


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"."""
    allowed = "'auto', 'cpu', 'cuda' or 'cuda:N'"
    if isinstance(name, torch.device):
        name = str(name)
    if not isinstance(name, str):
        raise ValueError(f"device must be {allowed}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must be {allowed}, got {name!r}") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device must be {allowed}, got {name!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available; use 'cpu' or 'auto'")
    n = torch.cuda.device_count()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if not 0 <= index < n:
        raise ValueError(f"device={name!r} but only {n} CUDA device(s) exist (cuda:0..cuda:{n - 1})")
    return torch.device("cuda", index)


def resolve_dtype(name: str | torch.dtype, model_cfg=None,                 # a config.ModelConfig
                  device: torch.device | str | None = None) -> torch.dtype:
    """"auto" -> the config's ``torch_dtype`` when it names float32/bfloat16/float16, otherwise
    float32 on CPU and bfloat16 on CUDA (``device`` None means ``resolve_device("auto")``)."""
    allowed = "'auto', 'float32', 'bfloat16' or 'float16'"
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise ValueError(f"dtype must be {allowed}, got {name}")
    if not isinstance(name, str):
        raise ValueError(f"dtype must be {allowed}, got {name!r}")
    if name != "auto":
        dt = _dtype_from_name(name)
        if dt is None:
            raise ValueError(f"dtype must be {allowed}, got {name!r}")
        return dt
    if model_cfg is not None and model_cfg.torch_dtype:
        dt = _dtype_from_name(str(model_cfg.torch_dtype))
        if dt is not None:
            return dt
    dev = resolve_device("auto") if device is None else torch.device(device)
    return torch.bfloat16 if dev.type == "cuda" else torch.float32
