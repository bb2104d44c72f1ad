"""Building blocks that hold no cache: norms, the relu² MLP (Nemotron-H), the SiLU-gated MLP
(Bamba, Falcon-H1; the MoE block is in moe.py).

Parameter names mirror the on-disk checkpoint names so the loader maps them 1:1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _nn_module   # the global forward hooks (project_relu2)

from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend

from .activation import relu2
from .linear import Linear
from .rmsnorm import add_rmsnorm_fp8, fp8_out_supported, fused_add_rmsnorm, rmsnorm


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

    def add_norm_for(self, x: torch.Tensor, residual: torch.Tensor | None, projections: tuple[nn.Module, ...]
                     ) -> tuple[object, torch.Tensor]:
        """``add_norm`` for a mixer whose input only ``projections`` read (``input_projections``),
        with the normed rows in the form they take: when they are FP8 projections that would each
        quantize the rows per token (``fp8.takes_fp8_rows``: prefill-sized rows), one
        ``fp8.Fp8Rows`` quantized by the norm kernel itself (the 16-bit rows are never written, and
        q/k/v share one quantization); the 16-bit rows otherwise. Same codes either way
        (tests/gpu/test_quant_cuda.py::test_fp8_norm_fusion_keeps_the_logits)."""
        # (a subclass may do more, e.g. all-reduce first)
        if projections and type(self) is RMSNorm and getattr(projections[0], "accepts_fp8_rows", False):
            from hybrid_engine.quantization.fp8 import Fp8Rows, log_norm_fusion, takes_fp8_rows
            if takes_fp8_rows(projections, x):
                fused = (x.stride(1) == 1 and fp8_out_supported(x.shape[1])
                         and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                                   and residual.stride(1) == 1))
                         and kernel_backend("rmsnorm" if residual is None else "fused_add_rmsnorm", x.device)
                         == "triton")
                log_norm_fusion("block RMSNorm", fused, x.shape[1])
                if fused:
                    codes, scale, residual = add_rmsnorm_fp8(x, residual, self.weight, self.eps)
                    return Fp8Rows(codes=codes, scale=scale, dtype=x.dtype), residual
        return self.add_norm(x, residual)


def project_relu2(proj: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``proj(relu2(h))``; a projection with a ``forward_relu2`` method applies the activation
    itself (``Fp8Linear``, ``Nvfp4Linear``, ``Linear``: as their FMA kernels load x, or the relu² kernel first). A module with forward hooks
    registered, its own or global ones (calibration, debugging), is called as a module so they
    still see its input."""
    fused = getattr(proj, "forward_relu2", None)
    if (fused is None or proj._forward_hooks or proj._forward_pre_hooks
            or _nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks):
        return proj(relu2(h))
    return fused(h)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project_relu2(self.down_proj, self.up_proj(x))

    def input_projections(self) -> tuple[nn.Module, ...]:
        """The modules that read this mixer's input, and nothing else does (``RMSNorm.add_norm_for``)."""
        return (self.up_proj,)


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x) * gate_scale) * up(x)) * down_scale (transformers' LlamaMLP;
    the scales are Falcon-H1's mlp_multipliers, 1.0 elsewhere, where they are skipped)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, gate_scale: float = 1.0,
                 down_scale: float = 1.0):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=bias)
        self.up_proj = Linear(hidden, inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.gate_scale, self.down_scale = float(gate_scale), float(down_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate_proj(x)
        if self.gate_scale != 1.0:
            g = g * self.gate_scale
        y = self.down_proj(F.silu(g) * self.up_proj(x))
        return y if self.down_scale == 1.0 else y * self.down_scale
