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

from .nvfp4 import GROUP, e2m1_times_block_scales
from .nvfp4_decode import _scaled_nibbles


@triton.jit
def _nvfp4_dequant_kernel(w_ptr, s_ptr, out_ptr, N, KG, s_wn, s_sn, s_on,
                          BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """out[n, 16g + 2j + i] = e2m1(nibble i of byte 8g + j of row n) * scale[n, g]: a [BLOCK_N,
    BLOCK_G] tile of 16-input groups, their 8 bytes -> 16 outputs. The block scales load as the
    [BLOCK_N, BLOCK_G] tile they are (a gather by byte // 8 took one 1-byte load a byte: ~1 TB/s
    on the H200) and broadcast over the group's bytes."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_j = tl.arange(0, 8)
    m = (offs_n < N)[:, None] & (offs_g < KG)[None, :]                                      # [BN, BG]
    rows = offs_n[:, None].to(tl.int64)
    byte = (offs_g[:, None] * 8 + offs_j[None, :])[None, :, :]                              # [1, BG, 8]
    wb = tl.load(w_ptr + rows[:, :, None] * s_wn + byte, mask=m[:, :, None], other=0).to(tl.int32)
    s = tl.load(s_ptr + rows * s_sn + offs_g[None, :], mask=m, other=0.0).to(tl.float32)
    lo, hi = _scaled_nibbles(wb, s[:, :, None], out_ptr.dtype.element_ty)
    pair = tl.join(lo, hi)                                                                  # [BN, BG, 8, 2]
    vals = tl.reshape(pair, [BLOCK_N, BLOCK_G * 16])
    offs_k = tl.program_id(1) * (BLOCK_G * 16) + tl.arange(0, BLOCK_G * 16)
    mk = (offs_n < N)[:, None] & (offs_k < 16 * KG)[None, :]
    tl.store(out_ptr + rows * s_on + offs_k[None, :], vals, mask=mk)


# (BLOCK_N rows, BLOCK_G 16-input groups) of a program (sweeps replace it). H200, 2026-11-29
# (_gpu sweep, bf16 out, TB/s of packed bytes + 16-bit writes): 4 x 64 at 3.34 / 3.34 / 3.59 on
# [14336, 4096] / [4096, 14336] / [237568, 2688], 16 x 16 at 3.26 / 3.33 / 3.16, 32 x 8 at
# 2.98 / 2.97 / 2.85; the byte-tiled kernel before took 1.0 TB/s (a block scale gathered per byte)
DEQUANT_TILES = (4, 64)


def dequantize_nvfp4_16bit_ref(packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torch twin: e2m1 * block scale (no global scale) -> [N, K] in ``dtype``, exactly."""
    return e2m1_times_block_scales(packed, weight_scale).to(dtype)


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
    bn, bg = DEQUANT_TILES
    _nvfp4_dequant_kernel[(cdiv(N, bn), cdiv(KB // 8, bg))](packed, weight_scale, out, N, KB // 8, packed.stride(0),
                                                             weight_scale.stride(0), out.stride(0), BLOCK_N=bn,
                                                             BLOCK_G=bg, num_warps=4)
    return out
