"""The NVFP4 decode shared by the Triton projection kernels (``nvfp4_fma_kernels``: 1-8 rows,
``nvfp4_kernels``: the tensor-core dot kernel and the dispatch).

The kernels read the packed weight [N, K/2] uint8 as int32 words (8 nibbles = inputs 8w .. 8w+7;
rows must be 4-byte aligned) and decode a word's 8 nibbles with a few integer ops per pair of
values: on CUDA, inline PTX builds nibbles j and j+4 of a word as one 2 x 16-bit register (the
magnitude bits shifted into a 16-bit float's low exponent / top mantissa bits, the sign to its
sign bit: e2m1 times a power of two, exactly, subnormals included). Triton's interpreter (no PTX)
runs the same kernels with ``_nibble_f32``, the one-value-at-a-time Triton twin of that decode,
which gives the same values (float32 and fp16 x there: the interpreter's bf16 ``tl.dot`` is not
exact, so the dot kernel refuses bf16 off CUDA); ``tests/quant`` runs it on CPU,
``tests/gpu/test_quant_cuda.py`` the PTX.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import triton_interpreting

from .nvfp4 import GROUP, _check_k


def _shift(dst: str, n: int, src: str = "$8") -> str:
    """PTX: dst = src (a word) shifted left by n (right by -n), logical."""
    if n == 0:
        return f"mov.b32 {dst}, {src};"
    return f"shl.b32 {dst}, {src}, {n};" if n > 0 else f"shr.b32 {dst}, {src}, {-n};"


def _pairs_ptx(mag_at: int, mag_mask: int, tail, src: str = "$8") -> str:
    """PTX over one int32 word (src): for j = 0..3 the nibbles j (bits 4j..4j+3) and j+4 (bits
    4j+16..) as a 2 x 16-bit register p: magnitude bits to bits mag_at.. of each half, sign bit to
    bit 15 of each half; ``tail(j)`` then uses p."""
    body = " ".join(f"{_shift('t0', mag_at - 4 * j, src)} {_shift('t1', 12 - 4 * j, src)} and.b32 t1, t1, 0x80008000; "
                    f"and.b32 t0, t0, {mag_mask:#010x}; or.b32 p, t0, t1; {tail(j)}" for j in range(4))
    return body


def _use_ptx(x: torch.Tensor) -> bool:
    return x.is_cuda and not triton_interpreting()


@triton.jit
def _nibble_f32(wd, J: tl.constexpr):
    """Nibble J (bits 4J .. 4J+3) of each int32 word -> float32 e2m1 * 2^-14, exactly: the three
    magnitude bits go to bits 9-11 of a float16 (its two lowest exponent bits and top mantissa
    bit) and the sign bit to bit 15, so e >= 1 gives 2^(e-15) (1 + m/2) and e = 0 the subnormal
    m * 2^-15: e2m1 scaled by 2^-14 in both cases; the hardware float16 -> float32 conversion keeps
    them exact (the kernels fold 2^14 into their scales). Shifts are per J at compile time: ~3 integer ops
    per value (and no int -> float conversion, which bounded the previous decode)."""
    if J <= 2:
        mag = (wd << (9 - 4 * J)) & 0xE00
    else:
        mag = (wd >> (4 * J - 9)) & 0xE00
    if J <= 3:
        sgn = (wd << (12 - 4 * J)) & 0x8000
    else:
        sgn = (wd >> (4 * J - 12)) & 0x8000
    return (mag | sgn).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scaled_nibbles(wb, s, DT: tl.constexpr):
    """Both nibbles of bytes ``wb`` (int32) times their block scale ``s`` (float32, broadcast to
    wb's shape; the decode's 2^14 is folded in here) -> (low, high) in DT, exactly: e2m1 times an
    e4m3 scale has at most 6 significant bits and lies within float16's normal range."""
    s = s * 16384.0
    return (_nibble_f32(wb, 0) * s).to(DT), (_nibble_f32(wb, 1) * s).to(DT)


def _check_x_dtype(x) -> None:
    # CUDA: the one-row and rows kernels round x (times a power of two) to float16, the dot kernel
    # multiplies in x's dtype; float32 x is for the interpreter's twins
    if _use_ptx(x) and x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_skinny_linear: x must be bfloat16 or float16 on CUDA, got {x.dtype}")


def _check_layout(x, packed, weight_scale, weight_scale_2) -> None:
    M, K = x.shape
    N = packed.shape[0]
    _check_k(K)
    if (packed.shape != (N, K // 2) or packed.dtype != torch.uint8 or weight_scale.shape != (N, K // GROUP)
            or weight_scale.dtype != torch.float8_e4m3fn or weight_scale_2.numel() != 1):
        raise ValueError(f"nvfp4_skinny_linear: x {tuple(x.shape)} needs weight [N, K/2] uint8, weight_scale "
                         f"[N, K/16] float8_e4m3fn, weight_scale_2 [] float32; got {tuple(packed.shape)} "
                         f"{packed.dtype}, {tuple(weight_scale.shape)} {weight_scale.dtype}, "
                         f"{tuple(weight_scale_2.shape)}")
    if x.stride(1) != 1 or packed.stride(1) != 1 or weight_scale.stride(1) != 1:
        raise ValueError("nvfp4_skinny_linear: x, weight and weight_scale need a unit inner stride")
    if packed.stride(0) % 4 or packed.data_ptr() % 4:
        # the kernels read the packed weight as int32 words (contiguous weights qualify: K / 2 is a
        # multiple of 8)
        raise ValueError(f"nvfp4_skinny_linear: the packed weight's rows must start on 4-byte boundaries "
                         f"(row stride {packed.stride(0)} bytes, offset {packed.data_ptr() % 4}); pass a "
                         "contiguous weight")
