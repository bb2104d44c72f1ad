"""config.json fields the other Mamba2 hybrid families' adapters share (Bamba, Granite-4.0-H,
Falcon-H1: the IBM-style ``mamba_*`` names, widths and heads, RoPE, the layer count); each
adapter (``config_kwargs(d)`` in its model module) combines these with the common parsing of
``hybrid_engine._config_parse``."""
from __future__ import annotations

from .._config_parse import parse_dtype, parse_eos, parse_time_step_limit

def field(d: dict, key: str, default):
    """config.json value of ``key``; a missing or null key takes ``default`` (as transformers)."""
    v = d.get(key)
    return default if v is None else v


def rope_fields(d: dict, head_dim: int, default_partial: float = 1.0) -> tuple[float, int]:
    """(rope_theta, rotary_dim) from ``rope_parameters`` (transformers 5) or the legacy top-level
    ``rope_theta`` / ``partial_rotary_factor``; only the "default" rope type is implemented."""
    rp = d.get("rope_parameters")
    if rp is None:
        rp = {}
    if not isinstance(rp, dict):
        raise ValueError(f"config.json rope_parameters must be an object, got {rp!r}")
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json rope_parameters.rope_type={rope_type!r} is not supported; allowed: "
                         "'default' (RoPE scaling variants are not implemented)")
    if d.get("rope_scaling") not in (None, {}):
        raise ValueError(f"config.json rope_scaling={d['rope_scaling']!r} is not supported (RoPE scaling "
                         "variants are not implemented); remove it or set it to null")
    theta = rp.get("rope_theta", field(d, "rope_theta", 10000.0))
    partial = rp.get("partial_rotary_factor", field(d, "partial_rotary_factor", default_partial))
    for name, v in (("rope_theta", theta), ("partial_rotary_factor", partial)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"config.json {name} must be a number > 0, got {v!r}")
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2 or partial > 1:
        raise ValueError(f"config.json partial_rotary_factor={partial!r} gives {rotary_dim} rotary dims of a "
                         f"{head_dim}-dim head; it must give an even number >= 2 and be <= 1")
    return float(theta), rotary_dim


def ibm_mamba_fields(d: dict, kw: dict, mamba_intermediate: int, *, n_heads: int = 128, n_groups: int = 1,
                     d_state: int = 256, d_conv: int = 4, chunk: int = 256) -> None:
    """The ``mamba_*`` fields of Bamba / Granite-4.0-H / Falcon-H1 into ``kw`` (defaults: theirs)."""
    kw["mamba_num_heads"] = field(d, "mamba_n_heads", n_heads)
    kw["n_groups"] = field(d, "mamba_n_groups", n_groups)
    kw["ssm_state_size"] = field(d, "mamba_d_state", d_state)
    kw["conv_kernel"] = field(d, "mamba_d_conv", d_conv)
    kw["chunk_size"] = field(d, "mamba_chunk_size", chunk)
    kw["use_conv_bias"] = field(d, "mamba_conv_bias", True)
    kw["use_bias"] = field(d, "mamba_proj_bias", False)
    kw["time_step_limit"] = parse_time_step_limit(d)
    h = kw["mamba_num_heads"]
    if not isinstance(h, int) or isinstance(h, bool) or h < 1:
        raise ValueError(f"config.json field mamba_n_heads must be an integer >= 1, got {h!r}")
    head = field(d, "mamba_d_head", "auto")
    if head == "auto":
        head = mamba_intermediate // h
    if not isinstance(head, int) or isinstance(head, bool) or head * h != mamba_intermediate:
        raise ValueError(f"config.json mamba_d_head={head!r} x mamba_n_heads={h} must equal the Mamba "
                         f"intermediate size {mamba_intermediate}")
    kw["mamba_head_dim"] = head


def common_fields(d: dict, kw: dict, *, vocab: int, hidden: int, inter: int, heads: int, kv_heads,
                  eps: float, pad, tie: bool = False) -> None:
    """Widths, attention heads, norms, special tokens and dtype shared by the IBM-style configs."""
    kw["vocab_size"] = field(d, "vocab_size", vocab)
    kw["hidden_size"] = field(d, "hidden_size", hidden)
    kw["intermediate_size"] = field(d, "intermediate_size", inter)
    kw["num_attention_heads"] = field(d, "num_attention_heads", heads)
    kw["num_key_value_heads"] = field(d, "num_key_value_heads", kv_heads) or kw["num_attention_heads"]
    for name in ("hidden_size", "num_attention_heads"):
        if not isinstance(kw[name], int) or isinstance(kw[name], bool) or kw[name] < 1:
            raise ValueError(f"config.json field {name} must be an integer >= 1, got {kw[name]!r}")
    kw["head_dim"] = field(d, "head_dim", kw["hidden_size"] // kw["num_attention_heads"])
    kw["layer_norm_epsilon"] = field(d, "rms_norm_eps", eps)
    kw["tie_word_embeddings"] = field(d, "tie_word_embeddings", tie)
    kw["pad_token_id"] = d.get("pad_token_id", pad)
    kw["bos_token_id"] = d.get("bos_token_id", 1)
    kw["eos_token_id"] = parse_eos(d.get("eos_token_id", 2))
    kw["torch_dtype"] = parse_dtype(d)
    kw["attention_bias"] = field(d, "attention_bias", False)
    kw["mlp_bias"] = field(d, "mlp_bias", False)
    for name in ("attention_bias", "mlp_bias"):
        if not isinstance(kw[name], bool):
            raise ValueError(f"config.json field {name} must be true or false, got {kw[name]!r}")


def layer_count(d: dict, default: int) -> int:
    n = field(d, "num_hidden_layers", default)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"config.json field num_hidden_layers must be an integer >= 1, got {n!r}")
    return n
