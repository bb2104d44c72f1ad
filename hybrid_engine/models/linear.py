"""``Linear``: ``nn.Linear`` whose forward sends decode-sized CUDA inputs to the Triton kernels of
``skinny_linear`` (one launch per projection, no split-K reduction kernel; 1.10x cuBLAS over the
projections of an 8B batch-1 decode step on an H100) and everything else to ``F.linear``.

The fast path takes 2-D inputs with at most ``MAX_ROWS`` rows, a unit inner stride and weights of
the input's dtype. 16-bit rows go to ``skinny_linear`` (FMA kernel for one row; for more, per
shape, the dot kernel, the FMA kernel or cuBLAS, so a 16-bit row's rounding may depend on how many
rows share the step); float32 rows go to ``skinny_linear_f32``, one FMA config for 1-8 rows, so a verify step of
at most 8 token rows (batch x (1 + k)) gets the same projection sums per row as a one-token step
(cuBLAS picks different kernels, with different summation orders, for 1 and 4 rows; steps of more
rows still go to cuBLAS). The backend is logged once through
``kernel_backend``; ``HYBRID_ENGINE_KERNELS=torch`` turns the fast path off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
from hybrid_engine.models.activation import relu2 as relu2_act

_MAX_ROWS = 8
_FAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           relu2: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; ``relu2``: of ``activation.relu2(x)``, which the decode FMA
    kernel applies as it loads x (no relu² kernel, no [M, K] round trip); the dot and cuBLAS routes
    run the relu² kernel first (``skinny_linear.skinny_linear``)."""
    if (x.dim() == 2 and x.shape[0] <= _MAX_ROWS and x.is_cuda and x.dtype in _FAST_DTYPES
            and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.stride(-1) == 1
            and kernel_backend("skinny_linear", x.device) == "triton"):
        from .skinny_linear import skinny_linear, skinny_linear_f32
        return (skinny_linear_f32 if x.dtype == torch.float32 else skinny_linear)(x, weight, bias, relu2=relu2)
    return F.linear(relu2_act(x) if relu2 else x, weight, bias)


class Linear(nn.Linear):
    """Same parameters and checkpoint names as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward_relu2(self, x: torch.Tensor) -> torch.Tensor:
        """``self(relu2(x))`` (``layers.project_relu2``: the relu² MLP's down_proj)."""
        return linear(x, self.weight, self.bias, relu2=True)
