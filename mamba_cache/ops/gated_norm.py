"""Gated RMSNorm of the Mamba2 mixer output (CONTRACT item 5).

``mode`` (one of ``GATE_MODES``): "gate_then_norm" (default; Nemotron-H, Bamba, Granite-4.0-H and
mamba-ssm's norm_before_gate=False): norm(y * silu(z)) * weight; "norm_then_gate" (Falcon-H1's
mamba_norm_before_gate=True): norm(y) * weight * silu(z); "gate_only" (Falcon-H1 with
mamba_rms_norm=False, no norm weight): y * silu(z)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gated_rmsnorm_ref(
    y: torch.Tensor,                    # [T, I] mixer output
    z: torch.Tensor,                    # [T, I] gate
    weight: torch.Tensor,               # [I]
    group_size: int,                    # I / n_groups
    eps: float,
    mode: str = "gate_then_norm",
) -> torch.Tensor:                      # [T, I] in y.dtype
    """g = y * silu(z) in float32, RMS-normalised per group of group_size channels, cast to
    y.dtype, then multiplied by weight (after the cast, as transformers does). The other modes
    (module docstring) follow transformers' FalconH1RMSNormGated: everything in float32, weight
    included, one cast to y.dtype at the end."""
    T, I = y.shape
    if mode == "gate_only":
        return (y.float() * F.silu(z.float())).to(y.dtype)
    if mode == "norm_then_gate":
        g = y.float().view(T, I // group_size, group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
        return (weight.float() * g.view(T, I) * F.silu(z.float())).to(y.dtype)
    if mode != "gate_then_norm":
        raise ValueError(f"gated norm mode must be one of {GATE_MODES}, got {mode!r}")
    g = y.float() * F.silu(z.float())                                     # [T, I]
    g = g.view(T, I // group_size, group_size)                            # [T, G, gs]
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * g.view(T, I).to(y.dtype)).to(y.dtype)


GATE_MODES = ("gate_then_norm", "norm_then_gate", "gate_only")


def gated_rmsnorm(y, z, weight, group_size, eps, mode: str = "gate_then_norm"):
    """Public entry point (CONTRACT item 5): Triton kernel on CUDA, torch reference elsewhere."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("gated_rmsnorm", y.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_norm import triton_gated_rmsnorm
        return triton_gated_rmsnorm(y, z, weight, group_size, eps, mode=mode)
    return gated_rmsnorm_ref(y, z, weight, group_size, eps, mode)
