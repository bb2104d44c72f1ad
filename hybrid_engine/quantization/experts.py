"""Quantized routed experts, weight-only, run by the fused MoE kernels on their stored bytes.

- ``Fp8Experts``: the merged expert weights stored as float8_e4m3fn with one float32 scale per
  expert and projection (``models/triton_moe.py``: the scale is applied in each kernel's
  epilogue; the CPU reference dequantizes exactly).
- ``Nvfp4Experts``: packed e2m1 weights with their 16-input block scales and one float32 scale per
  expert and projection (``nvfp4_experts.py``: decoded inside the kernels).

Checkpoint layout read (ModelOpt, per expert): ``<p>.experts.<e>.up_proj.weight`` ([F, D] float8;
NVFP4: [F, D/2] uint8), ``.weight_scale`` ([] float32; NVFP4: [F, D/16] float8_e4m3fn),
NVFP4's ``.weight_scale_2`` [] float32, and ``input_scale`` (read past: the experts are
weight-only); the same for ``down_proj``. The loader stacks them into ``up_proj`` [E, ...],
``up_proj_weight_scale`` [E, ...] and ``up_proj_weight_scale_2`` [E].
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.moe_ops import ExpertWeights
from .fp8 import FP8, quantize_fp8
from .linear import QuantLinear, _empty
from .nvfp4 import GROUP, quantize_nvfp4


class _QuantExperts(QuantLinear):
    """What the quantized merged experts share: ``like`` (an empty copy shaped as a 16-bit
    ``models.moe.Experts``) and the repr; subclasses name their ``FORMAT``."""
    FORMAT = ""

    @classmethod
    def like(cls, experts: nn.Module):
        E, F, D = experts.up_proj.shape
        return cls(E, D, F, device=experts.up_proj.device)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, inner={self.inner}, width={self.width}, {self.FORMAT}"


class Fp8Experts(_QuantExperts):
    """Drop-in for ``models.moe.Experts`` (same weight names) with FP8 weights and [E] scales."""
    FORMAT = "fp8"
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


class Nvfp4Experts(_QuantExperts):
    """Drop-in for ``models.moe.Experts`` with NVFP4 weights: ``up_proj`` [E, F, D/2] uint8,
    ``up_proj_weight_scale`` [E, F, D/16] float8_e4m3fn, ``up_proj_weight_scale_2`` [E] float32,
    the same for ``down_proj`` [E, D, F/2] (D, F: multiples of 16)."""
    FORMAT = "nvfp4"
    fixed_dtype_params = ("up_proj", "down_proj", "up_proj_weight_scale", "down_proj_weight_scale",
                          "up_proj_weight_scale_2", "down_proj_weight_scale_2")

    def __init__(self, num_experts: int, inner: int, width: int, device=None):
        super().__init__()
        if inner % GROUP or width % GROUP:
            raise ValueError(f"NVFP4 experts need widths that are multiples of {GROUP}, got {inner} and {width}")
        self.num_experts, self.inner, self.width = num_experts, inner, width
        E = num_experts
        self.up_proj = _empty((E, width, inner // 2), torch.uint8, device)
        self.down_proj = _empty((E, inner, width // 2), torch.uint8, device)
        self.up_proj_weight_scale = _empty((E, width, inner // GROUP), FP8, device)
        self.down_proj_weight_scale = _empty((E, inner, width // GROUP), FP8, device)
        self.up_proj_weight_scale_2 = _empty((E,), torch.float32, device)
        self.down_proj_weight_scale_2 = _empty((E,), torch.float32, device)

    def weights_for(self, rows: int):
        return ExpertWeights(up=self.up_proj, down=self.down_proj, up_scale=self.up_proj_weight_scale_2,
                             down_scale=self.down_proj_weight_scale_2, up_blocks=self.up_proj_weight_scale,
                             down_blocks=self.down_proj_weight_scale)

    @staticmethod
    def fits(experts: nn.Module) -> bool:
        """Whether both projections' input widths are multiples of the block (16)."""
        _, F, D = experts.up_proj.shape
        return D % GROUP == 0 and F % GROUP == 0

    @classmethod
    @torch.no_grad()
    def quantized_from(cls, experts: nn.Module) -> "Nvfp4Experts":
        """Each expert's projections quantized on their own (``quantize_nvfp4``), one at a time."""
        m = cls.like(experts)
        for src, (dst, blocks, scale) in ((experts.up_proj, (m.up_proj, m.up_proj_weight_scale, m.up_proj_weight_scale_2)),
                                          (experts.down_proj, (m.down_proj, m.down_proj_weight_scale,
                                                               m.down_proj_weight_scale_2))):
            for e in range(src.shape[0]):
                q, bs, gs = quantize_nvfp4(src[e])
                dst[e].copy_(q)
                blocks[e].copy_(bs)
                scale[e] = gs
        return m
