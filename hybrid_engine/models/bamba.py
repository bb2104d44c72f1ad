"""Bamba (IBM, ``model_type: "bamba"``): Mamba2 or attention, then a SwiGLU MLP, in every layer.

Against Nemotron-H (transformers' BambaForCausalLM is the reference):
- a decoder layer is two pre-norm residual steps: ``input_layernorm`` -> Mamba2 mixer (``mamba``)
  or attention (``self_attn``, the layers of ``attn_layer_indices``), then ``pre_ff_layernorm`` ->
  SwiGLU MLP (``feed_forward``: gate/up/down_proj, SiLU); Nemotron-H has one mixer per block;
- attention uses RoPE on half of each head (``partial_rotary_factor`` 0.5, transformers' fixed
  Bamba value unless ``rope_parameters`` says otherwise), optional q/k/v/o biases;
- the Mamba2 mixer is the shared one: gated RMSNorm with n_groups groups, gate after the norm
  input (norm_before_gate False), conv bias ``mamba_conv_bias``, projection biases
  ``mamba_proj_bias``, dt limited to ``time_step_limit`` (default (0, inf)) on every path;
- names: ``model.embed_tokens``, ``model.layers.N.*``, ``model.final_layernorm``, ``lm_head``.
The residual add of each step is fused into the next norm (as for Nemotron-H).
"""
from __future__ import annotations

import torch
from torch import nn

from .._config_parse import base_kwargs, finish_kwargs, reject_unless
from .family_config import common_fields, ibm_mamba_fields, layer_count, rope_fields
from ..config import ATTENTION, MAMBA, ModelConfig
from ..step.forward_batch import ForwardBatch
from .causal_lm import HybridCausalLM, layers_by_kind
from .layers import GatedMLP, RMSNorm
from .nemotron_h import Attention, Caches, Mamba2Mixer


def config_kwargs(d: dict) -> dict:
    """Bamba config.json -> ModelConfig kwargs (defaults: transformers' BambaConfig)."""
    kw = base_kwargs()
    reject_unless(d, "hidden_act", ("silu",), "silu", " (Bamba's MLP and Mamba conv use SiLU)")
    common_fields(d, kw, vocab=128000, hidden=4096, inter=14336, heads=32, kv_heads=8, eps=1e-5, pad=0)
    n = layer_count(d, 32)
    attn = d.get("attn_layer_indices") or []
    if not isinstance(attn, (list, tuple)) or any(not isinstance(i, int) or isinstance(i, bool)
                                                  or not 0 <= i < n for i in attn):
        raise ValueError(f"config.json attn_layer_indices must be a list of layer indices in [0, {n}), "
                         f"got {attn!r}")
    kw["layer_types"] = tuple(ATTENTION if i in attn else MAMBA for i in range(n))
    expand = field_int(d, "mamba_expand", 2)
    ibm_mamba_fields(d, kw, expand * kw["hidden_size"])
    kw["rope_theta"], kw["rotary_dim"] = rope_fields(d, kw["head_dim"], default_partial=0.5)
    kw["mlp_hidden_act"] = "silu"
    kw["model_type"] = "bamba"
    return finish_kwargs(kw)


def field_int(d: dict, key: str, default: int) -> int:
    v = d.get(key)
    v = default if v is None else v
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"config.json field {key} must be an integer >= 1, got {v!r}")
    return v


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, ordinal: int):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.input_layernorm = RMSNorm(d, eps)
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(cfg, ordinal)
        else:
            self.self_attn = Attention(cfg, ordinal)
        self.kind = kind
        self.pre_ff_layernorm = RMSNorm(d, eps)
        self.feed_forward = GatedMLP(d, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                caches: Caches) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous step's output, residual stream) -> (this layer's MLP output, residual);
        the residual adds run inside the next norm (``RMSNorm.add_norm``)."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        mixer = self.mamba if self.kind == MAMBA else self.self_attn
        x, residual = self.pre_ff_layernorm.add_norm(mixer(x, fb, caches), residual)
        return self.feed_forward(x), residual


class BambaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = layers_by_kind(cfg, BambaDecoderLayer)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class BambaForCausalLM(HybridCausalLM):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self._attach(cfg, BambaModel(cfg))

    def forward(self, fb: ForwardBatch, caches: Caches) -> torch.Tensor:
        """Final-normed hidden states [T, D] of every scheduled token."""
        return self._run_layers(fb, caches, self.model.final_layernorm)
