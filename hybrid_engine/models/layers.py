"""Nemotron-H building blocks that hold no cache: norms, MLP (the MoE block is in moe.py).

Parameter names mirror the on-disk checkpoint names so the loader maps them 1:1.
"""
from __future__ import annotations

import torch
from torch import nn

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
