"""Triton KV-cache write (CUDA): the new tokens' k and v into their cache slots in one launch.

The torch form (``ops.write_kv`` on CPU) is two ``index_copy_`` launches per attention layer, plus
the FP8 quantization's float32 passes with an FP8 cache; both are plain launches that break the
decode step's programmatic-dependent-launch chain (``triton_pdl``). Here one program per token
stores its [nkv, hd] k and v rows at ``slot_mapping[t]``: cast to the cache dtype (round to
nearest, as torch's ``.to``), or for a float8_e4m3fn cache the codes of ``x / scale`` clamped to
+-448, exactly ``ops.quantize_kv``'s (the W8A8 quantizer's division and rounding,
``fp8_quantizer._store_codes``). Duplicate slots (padding tokens in the null block): the last
writer is unspecified, as with ``index_copy_``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import device_ctx, next_pow2, triton_interpreting
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs
from hybrid_engine.quantization.fp8_quantizer import _store_codes


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, NKV, HD,
                     sk_t, sk_h, sv_t, sv_h, FP8: tl.constexpr, HW_ROUND: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    z = pdl_enter(PDL)
    t = (tl.program_id(0) + z).to(tl.int64)
    ks_ptr += z * 16            # the scales' addresses come from the wait too (triton_pdl's contract)
    vs_ptr += z * 16
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    m = (offs_h < NKV)[:, None] & (offs_d < HD)[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    dst = slot * NKV * HD + offs_h[:, None] * HD + offs_d[None, :]         # [BLOCK_H, BLOCK_D] in the flat cache
    k = tl.load(k_ptr + t * sk_t + offs_h[:, None] * sk_h + offs_d[None, :], mask=m, other=0.0)
    v = tl.load(v_ptr + t * sv_t + offs_h[:, None] * sv_h + offs_d[None, :], mask=m, other=0.0)
    if FP8:                     # kc_ptr / vc_ptr: the caches' bytes (uint8)
        _store_codes(kc_ptr + dst, k.to(tl.float32), tl.load(ks_ptr), m, HW_ROUND, True)
        _store_codes(vc_ptr + dst, v.to(tl.float32), tl.load(vs_ptr), m, HW_ROUND, True)
    else:
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)


def write_kv_supported(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> bool:
    """Whether ``write_kv_triton`` takes these tensors: k and v [T, nkv, hd] with the caches' nkv and
    hd and unit-stride head rows, one [T] slot vector with a unit stride, contiguous caches of one
    dtype. (Anything else goes to the torch form, which raises on mismatched shapes.)"""
    T = k.shape[0]
    return (k.dim() == 3 and k.shape == v.shape and tuple(k.shape[1:]) == tuple(k_cache.shape[-2:])
            and k_cache.shape == v_cache.shape and tuple(slot_mapping.shape) == (T,)
            and (T < 2 or slot_mapping.stride(0) == 1)
            and k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
            and k_cache.dtype == v_cache.dtype)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Same arguments and effect as ``ops.write_kv`` (k, v [T, nkv, hd]; caches [N, bs, nkv, hd];
    slot_mapping [T]; scales [] float32 with an FP8 cache, else None), for tensors
    ``write_kv_supported`` accepts."""
    T = k.shape[0]
    nkv, hd = k_cache.shape[-2:]
    if T == 0:
        return
    fp8 = k_scale is not None
    kc = k_cache.view(torch.uint8) if fp8 else k_cache
    vc = v_cache.view(torch.uint8) if fp8 else v_cache
    with device_ctx(k):
        _write_kv_kernel[(T,)](k, v, kc, vc, slot_mapping, k_scale if fp8 else kc, v_scale if fp8 else vc,
                               nkv, hd, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               FP8=fp8, HW_ROUND=not triton_interpreting(), BLOCK_H=next_pow2(nkv),
                               BLOCK_D=next_pow2(hd), num_warps=4, **pdl_kwargs(k.device))
