"""NVFP4 weights decoded to 16 bits in one Triton pass: the prefill path of ``nvfp4.nvfp4_linear``
(more than ``MAX_SKINNY_ROWS`` rows on CUDA), which multiplies the decoded weight on cuBLAS and
applies the global scale to the output.

``dequantize_nvfp4_16bit(packed [N, K/2] uint8, weight_scale [N, K/16] float8_e4m3fn, dtype)`` ->
[N, K] in ``dtype``: e2m1 * block scale without the global scale. That product has at most 6
significant bits and lies within float16's normal range, so it is exact in bfloat16, float16 and
float32, and the kernel equals its torch twin ``dequantize_nvfp4_16bit_ref`` bit for bit. The twin
took ~10 passes over the weight in 4- and 8-byte temporaries (codes as int64, float32 values and
scales) on every prefill call; the kernel reads the packed bytes and scales once and writes the
16-bit weight once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, kernel_backend

from .nvfp4 import GROUP, unpack_e2m1
from .nvfp4_decode import _nibble_f32


@triton.jit
def _nvfp4_dequant_kernel(w_ptr, s_ptr, out_ptr, N, KB, s_wn, s_sn, s_on,
                          BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """out[n, 2b + i] = e2m1(nibble i of byte b of row n) * scale[n, b // 8]: a [BLOCK_N, BLOCK_B]
    tile of bytes -> [BLOCK_N, 2 BLOCK_B] outputs, the two nibbles of a byte side by side."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_b = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    m = (offs_n < N)[:, None] & (offs_b < KB)[None, :]
    rows = offs_n[:, None].to(tl.int64)
    wb = tl.load(w_ptr + rows * s_wn + offs_b[None, :], mask=m, other=0).to(tl.int32)
    s = tl.load(s_ptr + rows * s_sn + (offs_b // 8)[None, :], mask=m, other=0.0).to(tl.float32) * 16384.0
    DT: tl.constexpr = out_ptr.dtype.element_ty
    pair = tl.join((_nibble_f32(wb, 0) * s).to(DT), (_nibble_f32(wb, 1) * s).to(DT))   # [BN, BB, 2]
    offs_k = 2 * offs_b[None, :, None] + tl.arange(0, 2)[None, None, :]
    tl.store(out_ptr + rows[:, :, None] * s_on + offs_k, pair, mask=m[:, :, None])


def dequantize_nvfp4_16bit_ref(packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torch twin: e2m1 * block scale (no global scale) -> [N, K] in ``dtype``, exactly."""
    return (unpack_e2m1(packed) * weight_scale.float().repeat_interleave(GROUP, dim=1)).to(dtype)


def dequantize_nvfp4_16bit(packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K/2] packed, [N, K/16] block scales -> [N, K] ``dtype`` (module docstring): Triton on CUDA,
    the twin elsewhere."""
    if kernel_backend("nvfp4_dequant", packed.device) != "triton":
        return dequantize_nvfp4_16bit_ref(packed, weight_scale, dtype)
    return dequantize_nvfp4_16bit_triton(packed, weight_scale, dtype)


def dequantize_nvfp4_16bit_triton(packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's launch (checked layout; the interpreter runs it on CPU tensors)."""
    N, KB = packed.shape
    if (KB % 8 or weight_scale.shape != (N, KB // 8) or packed.dtype != torch.uint8
            or weight_scale.dtype != torch.float8_e4m3fn or packed.stride(1) != 1 or weight_scale.stride(1) != 1):
        raise ValueError(f"dequantize_nvfp4_16bit: needs packed [N, K/2] uint8 (K a multiple of {GROUP}) and "
                         f"weight_scale [N, K/16] float8_e4m3fn with unit inner strides, got {tuple(packed.shape)} "
                         f"{packed.dtype}, {tuple(weight_scale.shape)} {weight_scale.dtype}")
    out = torch.empty(N, 2 * KB, dtype=dtype, device=packed.device)
    bn, bb = 16, 128
    _nvfp4_dequant_kernel[(cdiv(N, bn), cdiv(KB, bb))](packed, weight_scale, out, N, KB, packed.stride(0),
                                                       weight_scale.stride(0), out.stride(0), BLOCK_N=bn,
                                                       BLOCK_B=bb, num_warps=4)
    return out
