"""Nemotron-H building blocks that hold no cache: norms, MLP, MoE.

Parameter names mirror the on-disk checkpoint names so the loader maps them 1:1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .activation import relu2
from .linear import Linear
from .rmsnorm import fused_add_rmsnorm, rmsnorm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual step: -> (norm(r), r) with r = residual + x, one kernel on CUDA.
        residual None (the first block of a stack): r = x, no add."""
        if residual is None:
            return self(x), x
        return fused_add_rmsnorm(x, residual, self.weight, self.eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu2(self.up_proj(x)))


class TopkRouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k selection, weights from raw scores."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.top_k = cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()            # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]   # [T, topk_group]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        expert_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(expert_mask == 0, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]                  # [T, k]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


class MoE(nn.Module):
    """Routed relu^2 experts plus a shared expert.

    Torch path: each expert runs densely over all tokens and is weighted by the (mostly zero)
    routing weight, so nothing reads routing back to the host. Cost is E/k times the routed FLOPs;
    fine for the small MoE models this path serves (the 8B benchmark shape has no MoE).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inner = cfg.moe_latent_size or cfg.hidden_size
        self.gate = TopkRouter(cfg)
        self.experts = nn.ModuleList(MLP(inner, cfg.moe_intermediate_size, bias=False)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias)
        if cfg.moe_latent_size:
            self.fc1_latent_proj = Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x)
        dense_w = torch.zeros(x.shape[0], len(self.experts), dtype=torch.float32, device=x.device)
        dense_w.scatter_(1, idx, w)                                             # [T, E]
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        acc = torch.zeros(h.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            acc += expert(h).float() * dense_w[:, e:e + 1]
        out = acc.to(x.dtype)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        return out + self.shared_experts(x)
