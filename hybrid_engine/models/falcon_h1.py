"""Falcon-H1 (TII, ``model_type: "falcon_h1"``): a Mamba2 mixer and an attention side by side in
every layer, then a SwiGLU MLP, with muP multipliers.

Against Nemotron-H (transformers' FalconH1ForCausalLM is the reference):
- every decoder layer is HYBRID (``config.HYBRID``): it owns one Mamba state and one KV cache.
  ``input_layernorm`` -> x; ``mamba(x * ssm_in_multiplier) * ssm_out_multiplier`` +
  ``self_attn(x * attention_in_multiplier) * attention_out_multiplier`` is one residual step,
  then ``pre_ff_layernorm`` -> SwiGLU MLP (``feed_forward``, gate x mlp_multipliers[0], output x
  mlp_multipliers[1]) the second;
- the Mamba2 mixer is the shared one with Falcon's parameters: in_proj output multiplied per
  section (z, x, B, C, dt) by ``ssm_multipliers`` (transformers' muP vector), the Mamba width
  ``mamba_d_ssm`` (else mamba_expand x hidden), the gate applied before the grouped norm, after
  it (``mamba_norm_before_gate``) or alone without a norm (``mamba_rms_norm`` false, no
  ``mamba.norm.weight``), out_proj bias ``projectors_bias``, in_proj bias ``mamba_proj_bias``;
- attention: RoPE (full head unless ``partial_rotary_factor``), k x ``key_multiplier`` before
  RoPE, optional biases; embeddings x ``embedding_multiplier``; logits x ``lm_head_multiplier``;
- names: ``model.embed_tokens``, ``model.layers.N.*``, ``model.final_layernorm``, ``lm_head``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._config_parse import base_kwargs, finish_kwargs, reject_unless
from .family_config import common_fields, field, ibm_mamba_fields, layer_count, rope_fields
from ..config import HYBRID, ModelConfig
from ..step.forward_batch import ForwardBatch
from .causal_lm import HybridCausalLM
from .layers import GatedMLP, RMSNorm
from .nemotron_h import Attention, Caches, Mamba2Mixer


@dataclass(frozen=True)
class FalconH1Settings:
    """ModelConfig.family of falcon_h1: its multipliers and Mamba options."""
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    key_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    mamba_gate_mode: str = "gate_only"
    projectors_bias: bool = False


def _number(d: dict, key: str, default: float) -> float:
    v = field(d, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v == v:
        raise ValueError(f"config.json field {key} must be a number, got {v!r}")
    return float(v)


def _numbers(d: dict, key: str, default: tuple, n: int) -> tuple[float, ...]:
    v = field(d, key, list(default))
    if (not isinstance(v, (list, tuple)) or len(v) != n
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) for x in v)):
        raise ValueError(f"config.json field {key} must be a list of {n} numbers, got {v!r}")
    return tuple(float(x) for x in v)


def _bool(d: dict, key: str, default: bool) -> bool:
    v = field(d, key, default)
    if not isinstance(v, bool):
        raise ValueError(f"config.json field {key} must be true or false, got {v!r}")
    return v


def config_kwargs(d: dict) -> dict:
    """falcon_h1 config.json -> ModelConfig kwargs (defaults: transformers' FalconH1Config)."""
    kw = base_kwargs()
    reject_unless(d, "hidden_act", ("silu",), "silu", " (Falcon-H1's MLP and Mamba conv use SiLU)")
    common_fields(d, kw, vocab=128000, hidden=4096, inter=14336, heads=32, kv_heads=8, eps=1e-5, pad=0)
    n = layer_count(d, 32)
    kw["layer_types"] = (HYBRID,) * n
    d_ssm = d.get("mamba_d_ssm", 1024)
    if d_ssm is None:
        expand = field(d, "mamba_expand", 2)
        if not isinstance(expand, int) or isinstance(expand, bool) or expand < 1:
            raise ValueError(f"config.json field mamba_expand must be an integer >= 1, got {expand!r}")
        d_ssm = expand * kw["hidden_size"]
    if not isinstance(d_ssm, int) or isinstance(d_ssm, bool) or d_ssm < 1:
        raise ValueError(f"config.json field mamba_d_ssm must be null or an integer >= 1, got {d_ssm!r}")
    ibm_mamba_fields(d, kw, d_ssm)
    kw["rope_theta"], kw["rotary_dim"] = rope_fields(d, kw["head_dim"])
    kw["mlp_hidden_act"] = "silu"
    kw["model_type"] = "falcon_h1"
    rms_norm, before = _bool(d, "mamba_rms_norm", False), _bool(d, "mamba_norm_before_gate", True)
    kw["family"] = FalconH1Settings(
        embedding_multiplier=_number(d, "embedding_multiplier", 1.0),
        lm_head_multiplier=_number(d, "lm_head_multiplier", 1.0),
        key_multiplier=_number(d, "key_multiplier", 1.0),
        attention_in_multiplier=_number(d, "attention_in_multiplier", 1.0),
        attention_out_multiplier=_number(d, "attention_out_multiplier", 1.0),
        ssm_in_multiplier=_number(d, "ssm_in_multiplier", 1.0),
        ssm_out_multiplier=_number(d, "ssm_out_multiplier", 1.0),
        ssm_multipliers=_numbers(d, "ssm_multipliers", (1.0,) * 5, 5),
        mlp_multipliers=_numbers(d, "mlp_multipliers", (1.0, 1.0), 2),
        mamba_gate_mode=("norm_then_gate" if before else "gate_then_norm") if rms_norm else "gate_only",
        projectors_bias=_bool(d, "projectors_bias", False))
    return finish_kwargs(kw)


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ordinal: int):
        super().__init__()
        f: FalconH1Settings = cfg.family
        d, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.input_layernorm = RMSNorm(d, eps)
        self.mamba = Mamba2Mixer(cfg, ordinal, gate_mode=f.mamba_gate_mode, in_scale=f.ssm_in_multiplier,
                                 proj_scales=f.ssm_multipliers, out_bias=f.projectors_bias)
        self.self_attn = Attention(cfg, ordinal, key_scale=f.key_multiplier)
        self.pre_ff_layernorm = RMSNorm(d, eps)
        self.feed_forward = GatedMLP(d, cfg.intermediate_size, cfg.mlp_bias, gate_scale=f.mlp_multipliers[0],
                                     down_scale=f.mlp_multipliers[1])
        self.ssm_out, self.attn_in, self.attn_out = (f.ssm_out_multiplier, f.attention_in_multiplier,
                                                     f.attention_out_multiplier)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                caches: Caches) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous step's output, residual stream) -> (this layer's MLP output, residual); the
        residual adds run inside the next norm (``RMSNorm.add_norm``)."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        m = self.mamba(x, fb, caches)
        if self.ssm_out != 1.0:
            m = m * self.ssm_out
        a = self.self_attn(x if self.attn_in == 1.0 else x * self.attn_in, fb, caches)
        if self.attn_out != 1.0:
            a = a * self.attn_out
        x, residual = self.pre_ff_layernorm.add_norm(m + a, residual)
        return self.feed_forward(x), residual


class FalconH1Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(FalconH1DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class FalconH1ForCausalLM(HybridCausalLM):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self._attach(cfg, FalconH1Model(cfg))
        self.embedding_multiplier = cfg.family.embedding_multiplier
        self.logits_mul = cfg.family.lm_head_multiplier

    def forward(self, fb: ForwardBatch, caches: Caches) -> torch.Tensor:
        """Final-normed hidden states [T, D] of every scheduled token."""
        return self._run_layers(fb, caches, self.model.final_layernorm)
