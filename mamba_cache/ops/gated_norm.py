"""Gated RMSNorm of the Mamba2 mixer output (CONTRACT item 5, norm_before_gate=False)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rmsnorm_ref(
    y: torch.Tensor,                    # [T, I] mixer output
    z: torch.Tensor,                    # [T, I] gate
    weight: torch.Tensor,               # [I]
    group_size: int,                    # I / n_groups
    eps: float,
) -> torch.Tensor:                      # [T, I] in y.dtype
    """g = y * silu(z) in float32, RMS-normalised per group of group_size channels, cast to
    y.dtype, then multiplied by weight (after the cast, as transformers does)."""
    T, I = y.shape
    g = y.float() * F.silu(z.float())                                     # [T, I]
    g = g.view(T, I // group_size, group_size)                            # [T, G, gs]
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * g.view(T, I).to(y.dtype)).to(y.dtype)


def gated_rmsnorm(y, z, weight, group_size, eps):
    """Public entry point (CONTRACT item 5): Triton kernel on CUDA, torch reference elsewhere."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("gated_rmsnorm", y.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_norm import triton_gated_rmsnorm
        return triton_gated_rmsnorm(y, z, weight, group_size, eps)
    return gated_rmsnorm_ref(y, z, weight, group_size, eps)
