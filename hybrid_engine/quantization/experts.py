"""FP8 routed experts: the merged expert weights stored as float8_e4m3fn with one float32 scale per
expert and projection, run by the fused MoE kernels (``models/triton_moe.py``: the scale is
applied in each kernel's epilogue; the CPU reference dequantizes exactly).

Checkpoint layout read (ModelOpt, per expert): ``<p>.experts.<e>.up_proj.weight`` [F, D] float8,
``<p>.experts.<e>.up_proj.weight_scale`` [] float32 (and ``input_scale``, read past: the experts
are weight-only), the same for ``down_proj``; the loader stacks them into ``up_proj`` [E, F, D] and
``up_proj_weight_scale`` [E].
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.moe_ops import ExpertWeights
from .fp8 import FP8, quantize_fp8
from .linear import QuantLinear, _empty


class Fp8Experts(QuantLinear):
    """Drop-in for ``models.moe.Experts`` (same weight names) with FP8 weights and [E] scales."""
    fixed_dtype_params = ("up_proj", "down_proj", "up_proj_weight_scale", "down_proj_weight_scale")

    def __init__(self, num_experts: int, inner: int, width: int, device=None):
        super().__init__()
        self.num_experts, self.inner, self.width = num_experts, inner, width
        self.up_proj = _empty((num_experts, width, inner), FP8, device)
        self.down_proj = _empty((num_experts, inner, width), FP8, device)
        self.up_proj_weight_scale = _empty((num_experts,), torch.float32, device)
        self.down_proj_weight_scale = _empty((num_experts,), torch.float32, device)

    def weights_for(self, rows: int):
        """``models.moe_ops.ExpertWeights`` with the FP8 tensors and their [E] scales (any ``rows``)."""
        return ExpertWeights(up=self.up_proj, down=self.down_proj, up_scale=self.up_proj_weight_scale,
                             down_scale=self.down_proj_weight_scale)

    @classmethod
    def like(cls, experts: nn.Module) -> "Fp8Experts":
        E, F, D = experts.up_proj.shape
        return cls(E, D, F, device=experts.up_proj.device)

    @classmethod
    @torch.no_grad()
    def quantized_from(cls, experts: nn.Module) -> "Fp8Experts":
        """Per-expert per-tensor scales (amax / 448), one expert at a time."""
        m = cls.like(experts)
        for src, dst, scale in ((experts.up_proj, m.up_proj, m.up_proj_weight_scale),
                                (experts.down_proj, m.down_proj, m.down_proj_weight_scale)):
            for e in range(src.shape[0]):
                q, s = quantize_fp8(src[e], per_channel=False)
                dst[e].copy_(q)
                scale[e] = s
        return m

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, inner={self.inner}, width={self.width}, fp8"
