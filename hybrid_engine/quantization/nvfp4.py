"""NVFP4 weights (ModelOpt layout), weight-only: packing, exact dequantization, the linear op.

Stored per linear layer [N, K] (K a multiple of 16):
- ``weight`` [N, K // 2] uint8: two FP4 e2m1 codes per byte, element 2j in the low nibble and
  2j+1 in the high nibble; a code is sign (bit 3) and magnitude index (bits 0-2) into
  E2M1 = (0, 0.5, 1, 1.5, 2, 3, 4, 6);
- ``weight_scale`` [N, K // 16] float8_e4m3fn: one scale per 16 consecutive inputs of a row;
- ``weight_scale_2`` [] float32: the global scale; ``input_scale`` [] float32 (the activation scale
  of W4A4 on Blackwell; Hopper has no FP4 tensor cores, so it is loaded and unused).
Real weight: ``E2M1[code] * weight_scale[n, k // 16] * weight_scale_2``. ``e2m1 * block scale`` is
exact in bfloat16 (2 + 4 significant bits), so the kernel converts tiles losslessly and applies the
global scale once per output.

``nvfp4_linear``: CUDA with 16-bit x and at most 128 rows -> ``nvfp4_kernels.nvfp4_skinny_linear`` (decode
in registers: the packed weight's bytes, a quarter of bf16's); more rows on CUDA -> the weight dequantized to
x.dtype by one Triton pass (``nvfp4_dequant``; exact up to the global scale, applied to the output) and
cuBLAS with a float32 output (the unscaled sums leave float16's range); CPU / float32 ->
``nvfp4_linear_ref`` (exact float32 dequantization and matmul). ``relu2=True`` (the relu² MLP's
down_proj, ``Nvfp4Linear.forward_relu2``): the one-row kernel applies relu² as it loads x; every
other path runs ``activation.relu2`` first.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
from hybrid_engine.models.activation import relu2 as relu2_act

from .fp8 import FP8, FP8_MAX

GROUP = 16
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between consecutive magnitudes: |v| above bound i rounds to index i + 1
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# decode and verify batches up to this many rows take the kernel (it reads the packed weight once
# per 64-row tile); above, the weight is dequantized once per call and cuBLAS runs (prefill)
MAX_SKINNY_ROWS = 128


def _check_k(K: int) -> None:
    if K % GROUP:
        raise ValueError(f"NVFP4 needs the input width to be a multiple of {GROUP}, got {K}")


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (packed [N, K/2] uint8, block scales [N, K/16] float8_e4m3fn, global [] f32):
    global = amax / (6 * 448) so every block scale fits e4m3; block scale = round_e4m3(block amax
    / 6 / global); codes = nearest e2m1 of w / (block scale * global)."""
    N, K = w.shape
    _check_k(K)
    wf = w.detach().float()
    amax = wf.abs().amax()
    gscale = torch.where(amax > 0, amax / (E2M1_MAX * FP8_MAX), torch.ones_like(amax)).float()
    blocks = wf.view(N, K // GROUP, GROUP)
    bs = (blocks.abs().amax(dim=2) / E2M1_MAX / gscale).clamp(max=FP8_MAX).to(FP8)       # [N, K/16]
    denom = bs.float() * gscale
    v = blocks / torch.where(denom > 0, denom, torch.ones_like(denom))[..., None]
    mag = torch.bucketize(v.abs().clamp(max=E2M1_MAX),
                          torch.tensor(_E2M1_BOUNDS, device=w.device), right=False)       # 0..7
    codes = (mag | ((v < 0).to(mag.dtype) << 3)).to(torch.uint8).view(N, K)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), bs, gscale


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> [N, K] float32 e2m1 values (low nibble first)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()          # [N, K]
    # the magnitude from the code's bits (exponent e = bits 2..1, mantissa m = bit 0): m / 2 where
    # e = 0 (subnormal), else 2^(e-1) * (1 + m / 2); exact in float32 and E2M1_VALUES in order. No
    # host-built table: this runs inside CUDA graph capture (the torch fallback for float32 models)
    e, m = ((codes & 7) >> 1).float(), (codes & 1).float()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1.0 + 0.5 * m))
    return torch.where(codes >= 8, -mag, mag)


def e2m1_times_block_scales(packed, weight_scale) -> torch.Tensor:
    """-> [N, K] float32, exactly e2m1 * block scale (no global scale)."""
    return unpack_e2m1(packed) * weight_scale.float().repeat_interleave(GROUP, dim=1)


def dequantize_nvfp4(packed, weight_scale, weight_scale_2) -> torch.Tensor:
    """-> the weight [N, K] float32, exactly e2m1 * block scale * global scale."""
    return e2m1_times_block_scales(packed, weight_scale) * weight_scale_2.float()


def nvfp4_linear_ref(x, packed, weight_scale, weight_scale_2, bias=None):
    y = F.linear(x.float(), dequantize_nvfp4(packed, weight_scale, weight_scale_2),
                 None if bias is None else bias.float())
    return y.to(x.dtype)


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                 weight_scale_2: torch.Tensor, bias: torch.Tensor | None = None, *,
                 relu2: bool = False) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype (paths: module docstring). ``relu2``: the projection of
    ``activation.relu2(x)``; the one-row decode kernel applies it as it loads x, the other paths
    call ``relu2`` first."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    N = packed.shape[0]
    if x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16):
        if x2.shape[0] <= MAX_SKINNY_ROWS and kernel_backend("nvfp4_skinny_linear", x2.device) == "triton":
            from .nvfp4_kernels import nvfp4_skinny_linear
            return nvfp4_skinny_linear(x2.contiguous(), packed, weight_scale, weight_scale_2, bias,
                                       relu2=relu2).view(*lead, N)
        if relu2:
            x2 = relu2_act(x2)
        # prefill: e2m1 * block scale is exact in 16 bits; the global scale goes on the output. The
        # unscaled product is ~1 / weight_scale_2 (~1e4-1e5) times the real output, past float16's
        # 65504 for real outputs above ~2, so cuBLAS writes it in float32 (out_dtype; also one
        # rounding fewer, and no separate float conversion pass, for bfloat16)
        from .nvfp4_dequant import dequantize_nvfp4_16bit
        w16 = dequantize_nvfp4_16bit(packed, weight_scale, x2.dtype)          # one Triton pass
        y = torch.mm(x2, w16.t(), out_dtype=torch.float32) * weight_scale_2.float()
        if bias is not None:
            y = y + bias.float()
        return y.to(x2.dtype).view(*lead, N)
    if relu2:
        x2 = relu2_act(x2)
    return nvfp4_linear_ref(x2, packed, weight_scale, weight_scale_2, bias).view(*lead, N)
