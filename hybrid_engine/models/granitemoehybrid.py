"""IBM Granite-4.0-H (``model_type: "granitemoehybrid"``): Mamba2 or attention, then a MoE with a
shared SwiGLU MLP (or the shared MLP alone), in every layer, with Granite's multipliers.

Against Nemotron-H (transformers' GraniteMoeHybridForCausalLM is the reference):
- a decoder layer is two pre-norm residual steps: ``input_layernorm`` -> Mamba2 mixer (``mamba``)
  or attention (``self_attn``), then ``post_attention_layernorm`` -> routed experts
  (``block_sparse_moe``) + shared MLP (``shared_mlp``); with ``num_local_experts = 0`` the shared
  MLP alone;
- multipliers: embeddings x ``embedding_multiplier``; each step's output x ``residual_multiplier``
  before its residual add; attention softmax scale ``attention_multiplier`` (not head_dim^-0.5);
  logits / ``logits_scaling``;
- positional encoding: none (``position_embedding_type`` null or "nope", as published), or RoPE
  on the whole head (``"rope"``);
- router: top-k of the logits, weights = softmax of those k logits (the shared MoE ops with
  ``scoring="softmax"``); experts SwiGLU with merged gate/up weights ``input_linear`` [E, 2F, D]
  (gate rows first), ``output_linear`` [E, D, F] (the shared ops with ``activation="swiglu"``);
- shared MLP: ``input_linear`` [2S, D] (gate rows, then up rows), SiLU, ``output_linear``;
- the Mamba2 mixer is the shared one (as Bamba's); names ``model.embed_tokens``, ``model.layers.N.*``,
  ``model.norm``, ``lm_head`` (tied to the embeddings when ``tie_word_embeddings``).
16-bit numerics: the router runs in float32 and the k expert outputs are summed in float32
(transformers rounds the routing weights and the sum to the model dtype); float32 is exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .._config_parse import base_kwargs, finish_kwargs, reject_unless
from .family_config import common_fields, field, ibm_mamba_fields, layer_count, rope_fields
from ..config import ATTENTION, MAMBA, ModelConfig
from ..step.forward_batch import ForwardBatch
from .causal_lm import HybridCausalLM, layers_by_kind
from .layers import RMSNorm
from .linear import Linear
from .moe_ops import RouteSpec, route, routed_experts, router_logits
from .nemotron_h import Attention, Caches, Mamba2Mixer

_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": ATTENTION, "full_attention": ATTENTION}


@dataclass(frozen=True)
class GraniteSettings:
    """ModelConfig.family of granitemoehybrid: the multipliers and whether layers have experts."""
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    has_experts: bool = True


def _number(d: dict, key: str, default: float) -> float:
    v = field(d, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v == v:
        raise ValueError(f"config.json field {key} must be a number, got {v!r}")
    return float(v)


def config_kwargs(d: dict) -> dict:
    """granitemoehybrid config.json -> ModelConfig kwargs (defaults: transformers' config)."""
    kw = base_kwargs()
    reject_unless(d, "hidden_act", ("silu",), "silu", " (Granite-4.0-H's MLPs use SiLU)")
    # transformers: "rope" adds RoPE, anything else none; the published Granite-4.0-H configs say "nope"
    reject_unless(d, "position_embedding_type", (None, "nope", "rope"), None)
    reject_unless(d, "normalization_function", ("rmsnorm",), "rmsnorm")
    common_fields(d, kw, vocab=32000, hidden=4096, inter=11008, heads=32, kv_heads=None, eps=1e-6, pad=None)
    n = layer_count(d, 32)
    names = d.get("layer_types", d.get("layers_block_type"))
    if names is None:
        names = ["mamba"] * n
    if not isinstance(names, (list, tuple)) or len(names) != n:
        raise ValueError(f"config.json layer_types must be a list of {n} layer kinds (num_hidden_layers), "
                         f"got {names!r}")
    for i, name in enumerate(names):
        if name not in _KINDS:
            raise ValueError(f"config.json layer_types[{i}] is {name!r}; allowed: {', '.join(map(repr, _KINDS))}")
    kw["layer_types"] = tuple(_KINDS[name] for name in names)
    expand = field(d, "mamba_expand", 2)
    if not isinstance(expand, int) or isinstance(expand, bool) or expand < 1:
        raise ValueError(f"config.json field mamba_expand must be an integer >= 1, got {expand!r}")
    ibm_mamba_fields(d, kw, expand * kw["hidden_size"])
    if d.get("position_embedding_type") == "rope":
        kw["rope_theta"], kw["rotary_dim"] = rope_fields(d, kw["head_dim"])
    kw["attention_scale"] = _number(d, "attention_multiplier", 1.0)
    experts = field(d, "num_local_experts", 8)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise ValueError(f"config.json field num_local_experts must be an integer >= 0, got {experts!r}")
    kw["n_routed_experts"] = max(experts, 1)
    kw["num_experts_per_tok"] = field(d, "num_experts_per_tok", 2) if experts else 1
    kw["moe_intermediate_size"] = kw["intermediate_size"]          # each expert's F
    kw["moe_shared_expert_intermediate_size"] = field(d, "shared_intermediate_size", 1024)
    kw["moe_router"], kw["moe_activation"] = "softmax", "swiglu"
    kw["mlp_hidden_act"] = "silu"
    kw["model_type"] = "granitemoehybrid"
    kw["family"] = GraniteSettings(
        embedding_multiplier=_number(d, "embedding_multiplier", 1.0),
        residual_multiplier=_number(d, "residual_multiplier", 1.0),
        logits_scaling=_number(d, "logits_scaling", 1.0), has_experts=experts > 0)
    if kw["family"].logits_scaling == 0:
        raise ValueError("config.json field logits_scaling must be non-zero (logits are divided by it)")
    return finish_kwargs(kw)


class _Weight(nn.Module):
    """A tensor under the checkpoint name ``<module>.weight`` (merged expert weights)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class _Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int):
        super().__init__()
        self.layer = _Weight(num_experts, hidden)          # router.layer.weight [E, D]


class SharedMLP(nn.Module):
    """SwiGLU with merged gate/up rows: output_linear(silu(g) * u), (g, u) = input_linear(x).chunk(2)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.input_linear = Linear(hidden, 2 * inter, bias=False)
        self.output_linear = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(g) * u)


class GraniteMoE(nn.Module):
    """Routed SwiGLU experts over the shared MoE ops, with the per-expert load counters."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, d, f = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.spec = RouteSpec(num_experts=e, top_k=cfg.num_experts_per_tok, scoring="softmax")
        self.router = _Router(e, d)
        self.input_linear = _Weight(e, 2 * f, d)             # [E, 2F, D]: gate rows, then up rows
        self.output_linear = _Weight(e, d, f)                # [E, D, F]
        self.register_buffer("expert_tokens", torch.zeros(e, dtype=torch.int32), persistent=False)
        self.register_buffer("_no_bias", torch.zeros(e, dtype=torch.float32), persistent=False)

    def reset_runtime_state(self) -> None:
        self.expert_tokens.zero_()
        self._no_bias.zero_()

    def read_expert_load(self) -> list[int]:
        """Tokens routed to each expert since the last read (host sync: stats only)."""
        counts = self.expert_tokens.tolist()
        self.expert_tokens.zero_()
        return counts

    def forward(self, x: torch.Tensor, fb: ForwardBatch, add: torch.Tensor) -> torch.Tensor:
        """routed(x) + add (the shared MLP's output), [T, D]; padding tokens (slot 0) not counted."""
        ids, w = route(router_logits(x, self.router.layer.weight), self._no_bias, self.spec,
                       self.expert_tokens, fb.attn.slot_mapping[:x.shape[0]])
        return routed_experts(x, self.input_linear.weight, self.output_linear.weight, ids, w, add=add,
                              activation="swiglu")


class GraniteDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, ordinal: int):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.kind = kind
        self.residual_multiplier = cfg.family.residual_multiplier
        self.input_layernorm = RMSNorm(d, eps)
        if kind == MAMBA:
            self.mamba = Mamba2Mixer(cfg, ordinal)
        else:
            self.self_attn = Attention(cfg, ordinal)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.shared_mlp = SharedMLP(d, cfg.moe_shared_expert_intermediate_size)
        self.block_sparse_moe = GraniteMoE(cfg) if cfg.family.has_experts else None

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.residual_multiplier == 1.0 else y * self.residual_multiplier

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch,
                caches: Caches) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous step's scaled output, residual stream) -> (this layer's scaled FFN output,
        residual); the adds run inside the next norm (``RMSNorm.add_norm``)."""
        x, residual = self.input_layernorm.add_norm(h, residual)
        mixer = self.mamba if self.kind == MAMBA else self.self_attn
        x, residual = self.post_attention_layernorm.add_norm(self._scaled(mixer(x, fb, caches)), residual)
        y = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            y = self.block_sparse_moe(x, fb, add=y)              # moe(x) + shared_mlp(x)
        return self._scaled(y), residual


class GraniteModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = layers_by_kind(cfg, GraniteDecoderLayer)
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class GraniteMoeHybridForCausalLM(HybridCausalLM):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self._attach(cfg, GraniteModel(cfg))
        self.embedding_multiplier = cfg.family.embedding_multiplier
        self.logits_div = cfg.family.logits_scaling

    def forward(self, fb: ForwardBatch, caches: Caches) -> torch.Tensor:
        """Final-normed hidden states [T, D] of every scheduled token."""
        return self._run_layers(fb, caches, self.model.norm)
