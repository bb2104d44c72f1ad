"""config.json -> ModelConfig keyword arguments (private helper of ``hybrid_engine.config``).

``model_type`` (or, when absent, ``architectures``) picks the family in
``hybrid_engine.models.families.FAMILIES``; every family but ``nemotron_h`` has its config adapter
in its own model module (``config_kwargs(d)``), which uses the helpers below (``base_kwargs``,
``parse_eos``, ``parse_time_step_limit``, ``parse_dtype``, ``reject_unless``) and those of
``hybrid_engine.models.family_config`` (the fields the IBM-style configs share), and ends in
``finish_kwargs`` (the common type and shape checks).

Accepted forms for ``model_type == "nemotron_h"``:

- transformers 5 (``save_pretrained``): ``layers_block_type`` (alias ``layer_types``), a list of
  ``linear_attention | full_attention | mlp | moe`` (legacy ``mamba`` / ``attention`` too);
  ``mtp_layers_block_type`` the same; ``dtype``; special floats as ``{"__float__": "Infinity"}``
  (also ``"-Infinity"``, ``"NaN"``).
- published checkpoints: ``hybrid_override_pattern`` ("M-*E": M Mamba2, * attention, - MLP,
  E MoE), ``mtp_hybrid_override_pattern``, ``torch_dtype``, the ``mamba_*`` legacy names
  (``mamba_n_groups``, ``mamba_d_conv``, ``mamba_expand`` (ignored), ``mamba_dt_min``,
  ``mamba_dt_max``, ``mamba_dt_limit``, ``mamba_dt_init_floor``, ``mamba_conv_bias``,
  ``mamba_chunk_size``), ``attention_head_dim`` (Nemotron-H 8B/47B: the attention head size when
  ``head_dim`` is absent) and bare ``Infinity`` / ``NaN`` literals.
- ``quantization_config`` (or ``compression_config``; ``hf_quant_config.json`` beside config.json
  is merged by ``ModelConfig.from_json``): NVIDIA ModelOpt FP8 / NVFP4 is parsed into
  ``ModelConfig.quantization`` (``hybrid_engine.quantization.config``); any other method is a
  ValueError naming it.
- ``eos_token_id`` must lie inside the vocabulary.

Precedence follows transformers' ``NemotronHConfig``: a legacy ``mamba_*`` name overrides its
canonical twin; ``layers_block_type`` overrides ``hybrid_override_pattern``; a missing field takes
transformers' default, so the engine builds the same model transformers would.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from hybrid_engine.config import ATTENTION, HYBRID, MAMBA, MLP, MOE

logger = logging.getLogger(__name__)

from hybrid_engine.models.families import FAMILIES, family_of

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

_KIND_BY_NAME = {"linear_attention": MAMBA, "full_attention": ATTENTION, "mlp": MLP, "moe": MOE,
                 "mamba": MAMBA, "attention": ATTENTION}
_KIND_NAMES = "'linear_attention', 'full_attention', 'mlp', 'moe'"
_PATTERN_CHARS = (MAMBA, ATTENTION, MLP, MOE)
_DEFAULT_LAYERS = ("linear_attention", "moe", "full_attention", "mlp")   # transformers' default

# legacy name -> canonical name (transformers' NemotronHConfig.__post_init__)
_LEGACY = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_expand": "expand",
           "mamba_dt_min": "time_step_min", "mamba_dt_max": "time_step_max",
           "mamba_dt_limit": "time_step_limit", "mamba_dt_init_floor": "time_step_floor",
           "mamba_conv_bias": "use_conv_bias", "mamba_chunk_size": "chunk_size"}

# canonical field -> transformers default (only the fields ModelConfig keeps)
_HF_DEFAULTS = dict(
    vocab_size=131072, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=21504, mlp_hidden_act="relu2", mlp_bias=False,
    mamba_num_heads=128, mamba_head_dim=64, mamba_hidden_act="silu", n_groups=8, ssm_state_size=128,
    conv_kernel=4, chunk_size=128, use_conv_bias=True, time_step_min=0.001,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=7688,
    moe_shared_expert_intermediate_size=7688, n_shared_experts=1, n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=1.0, moe_latent_size=None,
    num_nextn_predict_layers=0, use_bias=False, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    pad_token_id=0, bos_token_id=1,
)
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                  "conv_kernel", "chunk_size", "n_routed_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "moe_shared_expert_intermediate_size", "n_group", "topk_group")
_NONNEG_INTS = ("num_nextn_predict_layers", "n_shared_experts")
_BOOLS = ("mlp_bias", "use_conv_bias", "norm_topk_prob", "use_bias", "tie_word_embeddings")
_FLOATS = ("time_step_min", "routed_scaling_factor", "layer_norm_epsilon")
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def read_config_json(path) -> dict:
    """Load config.json from a file path or a model folder; ValueError when missing or not JSON."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        where = f"folder {p.parent}" if p.name == "config.json" else str(p)
        raise ValueError(f"config.json not found: {where} has no config.json (a model folder needs "
                         "config.json and *.safetensors weights)")
    try:
        text = p.read_text(encoding="utf-8")
        d = json.loads(text)      # Python's json accepts bare Infinity / -Infinity / NaN
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{p} must hold a JSON object, got {type(d).__name__}")
    return d


def decode_special_floats(obj):
    """``{"__float__": "Infinity"}`` (and -Infinity, NaN) -> float, recursively."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and isinstance(obj["__float__"], str):
            tag = obj["__float__"]
            if tag not in _FLOAT_TAGS:
                raise ValueError(f"unknown special float {{'__float__': {tag!r}}}; "
                                 f"allowed: {', '.join(_FLOAT_TAGS)}")
            return _FLOAT_TAGS[tag]
        return {k: decode_special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_special_floats(v) for v in obj]
    return obj


def _kinds_from_list(field: str, value) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{field} must be a list of layer kinds ({_KIND_NAMES}), got {value!r}")
    kinds = []
    for i, name in enumerate(value):
        if not isinstance(name, str) or name not in _KIND_BY_NAME:
            raise ValueError(f"{field}[{i}] (layer {i}) is {name!r}, an unknown layer kind; "
                             f"allowed: {_KIND_NAMES}")
        kinds.append(_KIND_BY_NAME[name])
    return tuple(kinds)


def _kinds_from_pattern(field: str, value) -> tuple[str, ...]:
    if not isinstance(value, str):
        raise ValueError(f"{field} must be a string of layer symbols (M, *, -, E), got {value!r}")
    for i, ch in enumerate(value):
        if ch not in _PATTERN_CHARS:
            raise ValueError(f"{field}[{i}] (layer {i}) is {ch!r}, an unknown layer kind; allowed: "
                             "'M' (Mamba2), '*' (attention), '-' (MLP), 'E' (MoE)")
    return tuple(value)


def _layer_kinds(d: dict) -> tuple[str, ...]:
    for key in ("layers_block_type", "layer_types"):
        if d.get(key) is not None:
            kinds = _kinds_from_list(key, d[key])
            break
    else:
        if d.get("hybrid_override_pattern") is not None:
            kinds = _kinds_from_pattern("hybrid_override_pattern", d["hybrid_override_pattern"])
        else:
            logger.warning("config.json has no layers_block_type / hybrid_override_pattern; using "
                           "transformers' default %s", list(_DEFAULT_LAYERS))
            kinds = _kinds_from_list("layers_block_type", list(_DEFAULT_LAYERS))
    if not kinds:
        raise ValueError("layers_block_type is empty; the model needs at least one layer")
    n = d.get("num_hidden_layers")
    if n is not None and n != len(kinds):
        logger.warning("config.json: num_hidden_layers=%s does not match the %d layers of the layer "
                       "pattern; using the pattern", n, len(kinds))
    return kinds


def _mtp_kinds(d: dict) -> tuple[str, ...]:
    default = (ATTENTION, MOE)
    lst = d.get("mtp_layers_block_type")
    kinds = _kinds_from_list("mtp_layers_block_type", lst) if lst is not None else None
    pat = d.get("mtp_hybrid_override_pattern")
    # transformers: the legacy pattern wins when the list is absent or equal to the default
    if pat is not None and (kinds is None or kinds == default):
        kinds = _kinds_from_pattern("mtp_hybrid_override_pattern", pat)
    return kinds if kinds is not None else default


def parse_eos(value) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, (list, tuple)) else [value]
    for v in items:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"eos_token_id must be a non-negative integer or a list of them, got {value!r}")
    return tuple(items)


def _check_types(kw: dict) -> None:
    for name in _POSITIVE_INTS + _NONNEG_INTS:
        v, lo = kw[name], (0 if name in _NONNEG_INTS else 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"config.json field {name} must be an integer >= {lo}, got {v!r}")
    for name in _BOOLS:
        if not isinstance(kw[name], bool):
            raise ValueError(f"config.json field {name} must be true or false, got {kw[name]!r}")
    for name in _FLOATS:
        v = kw[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise ValueError(f"config.json field {name} must be a number, got {v!r}")
        kw[name] = float(v)
    if kw["layer_norm_epsilon"] <= 0:
        raise ValueError(f"config.json field layer_norm_epsilon must be > 0, got {kw['layer_norm_epsilon']}")
    for name in ("pad_token_id", "bos_token_id"):
        v = kw[name]
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"config.json field {name} must be null or an integer >= 0, got {v!r}")
    lat = kw["moe_latent_size"]
    if lat is not None and (not isinstance(lat, int) or isinstance(lat, bool) or lat < 1):
        raise ValueError(f"config.json field moe_latent_size must be null or an integer >= 1, got {lat!r}")


def _check_shapes(kw: dict) -> None:
    kinds = set(kw["layer_types"])
    if kw["num_nextn_predict_layers"] > 0:
        kinds |= set(kw["mtp_layer_types"])
    if kinds & {ATTENTION, HYBRID} and kw["num_attention_heads"] % kw["num_key_value_heads"]:
        raise ValueError(f"num_attention_heads ({kw['num_attention_heads']}) must be a multiple of "
                         f"num_key_value_heads ({kw['num_key_value_heads']})")
    if kinds & {MAMBA, HYBRID} and kw["mamba_num_heads"] % kw["n_groups"]:
        raise ValueError(f"mamba_num_heads ({kw['mamba_num_heads']}) must be a multiple of "
                         f"n_groups ({kw['n_groups']})")
    if MOE in kinds:
        e = kw["n_routed_experts"]
        if kw["num_experts_per_tok"] > e:
            raise ValueError(f"num_experts_per_tok ({kw['num_experts_per_tok']}) must be <= "
                             f"n_routed_experts ({e})")
        if e % kw["n_group"] or kw["topk_group"] > kw["n_group"]:
            raise ValueError(f"n_group ({kw['n_group']}) must divide n_routed_experts ({e}) and "
                             f"topk_group ({kw['topk_group']}) must be <= n_group")
        if kw["n_group"] > 1 and e // kw["n_group"] < 2:
            raise ValueError(f"n_routed_experts / n_group must be >= 2 (group scores sum the top 2), "
                             f"got {e} / {kw['n_group']}")


def model_config_kwargs(d: dict) -> dict:
    """Validate and normalise a config.json dict into ModelConfig keyword arguments."""
    if not isinstance(d, dict):
        raise ValueError(f"config must be a dict, got {type(d).__name__}")
    d = decode_special_floats(d)
    mt = d.get("model_type")
    if mt is None:
        mt = family_of(d.get("architectures"))
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not supported; supported: "
                         f"{', '.join(map(repr, SUPPORTED_MODEL_TYPES))}")
    d = dict(d)
    _check_ssm_cache_dtype(d)
    if mt != "nemotron_h":
        _reject_quantization(d, mt)
        return FAMILIES[mt].config_adapter()(d)
    from hybrid_engine.quantization.config import parse_checkpoint_quantization
    quantization = parse_checkpoint_quantization(d)
    if d.get("head_dim") is None and d.get("attention_head_dim") is not None:
        d["head_dim"] = d["attention_head_dim"]
    elif d.get("attention_head_dim") is not None and d["attention_head_dim"] != d["head_dim"]:
        logger.warning("config.json sets head_dim=%r and attention_head_dim=%r; using head_dim (as "
                       "transformers does)", d["head_dim"], d["attention_head_dim"])
    for legacy, canon in _LEGACY.items():
        if legacy in d:
            if canon in d and d[canon] != d[legacy]:
                logger.warning("config.json sets both %s=%r and %s=%r; using %s (as transformers does)",
                               legacy, d[legacy], canon, d[canon], legacy)
            d[canon] = d.pop(legacy)

    kw = {k: d.get(k, default) for k, default in _HF_DEFAULTS.items()}
    for k in ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "mamba_num_heads",
              "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel", "chunk_size"):
        if kw[k] is None:   # null in the file: fall back like a missing field
            kw[k] = _HF_DEFAULTS[k]
    if kw["num_key_value_heads"] is None:
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    if kw["head_dim"] is None:
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    if kw["mlp_hidden_act"] != "relu2":
        raise ValueError(f"mlp_hidden_act {kw['mlp_hidden_act']!r} is not supported; allowed: 'relu2'")
    if kw["mamba_hidden_act"] != "silu":
        raise ValueError(f"mamba_hidden_act {kw['mamba_hidden_act']!r} is not supported; allowed: 'silu'")
    kw["layer_types"] = _layer_kinds(d)
    kw["mtp_layer_types"] = _mtp_kinds(d)
    kw["eos_token_id"] = parse_eos(d.get("eos_token_id", 2))
    kw["time_step_limit"] = parse_time_step_limit(d)
    kw["torch_dtype"] = parse_dtype(d)
    kw["quantization"] = quantization
    return finish_kwargs(kw)


def parse_time_step_limit(d: dict) -> tuple[float, float]:
    lim = d.get("time_step_limit", (0.0, math.inf))
    if lim is None:
        lim = (0.0, math.inf)
    if (not isinstance(lim, (list, tuple)) or len(lim) != 2
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) for x in lim)
            or lim[0] > lim[1]):
        raise ValueError(f"time_step_limit must be a pair [low, high] of numbers with low <= high "
                         f"(high may be Infinity), got {lim!r}")
    return (float(lim[0]), float(lim[1]))


def parse_dtype(d: dict) -> str | None:
    dt = d.get("dtype", d.get("torch_dtype"))
    if dt is not None and not isinstance(dt, str):
        raise ValueError(f"config.json field dtype must be a string such as 'bfloat16', got {dt!r}")
    return dt.removeprefix("torch.") if dt else None


def base_kwargs() -> dict:
    """ModelConfig keyword arguments at transformers' NemotronHConfig defaults: the starting point
    of a family adapter, which overwrites the fields its config.json sets."""
    return dict(_HF_DEFAULTS, mtp_layer_types=(ATTENTION, MOE), eos_token_id=(2,),
                time_step_limit=(0.0, math.inf), torch_dtype=None)


def reject_unless(d: dict, key: str, allowed: tuple, default=None, what: str = "") -> None:
    """ValueError naming ``key`` when config.json sets it to a value outside ``allowed`` (a
    feature this engine does not implement for the family)."""
    v = d.get(key, default)
    if v not in allowed:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"config.json {key}={v!r} is not supported{what}; allowed: {shown}")


def finish_kwargs(kw: dict) -> dict:
    """The checks every family shares: field types, divisibility, EOS ids inside the vocabulary."""
    _check_types(kw)
    _check_shapes(kw)
    outside = [e for e in kw["eos_token_id"] if e >= kw["vocab_size"]]
    if outside:
        raise ValueError(f"config.json eos_token_id {outside[0]} is outside the vocabulary "
                         f"[0, {kw['vocab_size']})")
    return kw


def _check_ssm_cache_dtype(d: dict) -> None:
    """``mamba_ssm_cache_dtype`` (the published Nemotron-H and Nemotron 3 configs say "float32"):
    the dtype a checkpoint wants its Mamba SSM state kept in. This engine keeps that state in
    float32 (``MambaPool``); any other value is refused here rather than silently kept in float32."""
    v = d.get("mamba_ssm_cache_dtype")
    if v is None:
        return
    import torch

    from hybrid_engine.device_dtype import _dtype_from_name
    if not (isinstance(v, str) and _dtype_from_name(v) is torch.float32):
        raise ValueError(f"config.json field mamba_ssm_cache_dtype is {v!r}: this engine keeps the Mamba SSM "
                         "state in float32 only; allowed: 'float32' or no such field (a 16-bit SSM state "
                         "is not implemented)")


def _reject_quantization(d: dict, model_type: str) -> None:
    for key in ("quantization_config", "compression_config"):
        q = d.get(key)
        if q is None:
            continue
        method = q.get("quant_method", q.get("quant_algo", q.get("format"))) if isinstance(q, dict) else q
        raise ValueError(f"config.json {key} (quant_method {method!r}) is not supported for model_type "
                         f"{model_type!r}: quantized checkpoints load for 'nemotron_h' only; use the "
                         "checkpoint's unquantized (BF16) release")
