"""Triton router of the MoE block (CUDA; the torch twin is ``moe_ops.route_ref``).

``_route_kernel``: one program per token: sigmoid of the router logits, correction bias for the
choice only, group-limited top-k by repeated argmax, renormalisation and scaling (SOFTMAX: top-k
of the logits themselves, weights the softmax of the k chosen logits); optionally adds the
token's choices to the per-expert counters (atomics, padding tokens skipped). Fixed-size outputs
[T, k]: no host sync, safe inside CUDA graphs.

``_router_logits_kernel`` (prefill-sized bf16 rows): the router's float32 logits x @ W^T on the
bf16 tensor cores. Each float32 weight tile is split in registers into three bf16 parts, hi =
bf16(w), mid = bf16(w - hi), lo = bf16(w - hi - mid), whose sum is w (24 significant bits in
three of 8) for 2^-110 <= |w| <= ~3.39e38: smaller weights lose bits below 2^-133, larger ones
round hi to inf (router weights are far inside). Each K step takes three dots
from zero and adds their sum to a float32 accumulator (the tensor cores' own accumulation keeps
fewer bits); a bf16 x times a bf16 part is exact in float32, so the logits match a float32 GEMM
(twin: ``F.linear(x.float(), w)``) up to accumulation error; an infinite x gives NaN where a part
is 0. cuBLAS's float32 GEMM (no tensor cores) took 2.9 ms of a 43 ms
2048-token Nano prefill on the H200 (2026-11-29).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import next_pow2, triton_interpreting
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs

from .moe_ops import RouteSpec


# one warp per token: the top-k's repeated argmax reductions then stay inside the warp. H100
# (benchmarks/results/2026-11-26-pdl-h100.md): Nano (128 experts, top-6) 2.69 -> 1.80 us, Super (512,
# top-22) 9.49 -> 8.19 us per call at 1-8 tokens, outputs bitwise the same as with 4 warps
_ROUTE_WARPS = 1


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, cnt_ptr, valid_ptr, E, s_l, scale,
                  TOP_K: tl.constexpr, N_GROUP: tl.constexpr, PER_GROUP: tl.constexpr,
                  TOPK_GROUP: tl.constexpr, RENORM: tl.constexpr, COUNT: tl.constexpr,
                  HAS_VALID: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_G: tl.constexpr, SOFTMAX: tl.constexpr = False, PDL: tl.constexpr = False):
    t = tl.program_id(0) + pdl_enter(PDL)
    offs = tl.arange(0, BLOCK_E)
    me = offs < E
    lg = tl.load(logits_ptr + t.to(tl.int64) * s_l + offs, mask=me, other=0.0).to(tl.float32)
    if SOFTMAX:                         # choose by the logits; weights come from them below
        score = lg
    else:
        score = 1.0 / (1.0 + tl.exp(-lg))
    bias = tl.load(bias_ptr + offs, mask=me, other=0.0).to(tl.float32)
    choice = tl.where(me, score + bias, float("-inf"))
    if N_GROUP > 1:                     # keep the TOPK_GROUP groups with the best top-2 sums
        grp = offs // PER_GROUP
        g_offs = tl.arange(0, BLOCK_G)
        g_score = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            v = tl.where(grp == g, choice, float("-inf"))
            m1 = tl.max(v, axis=0)
            s = m1
            if PER_GROUP > 1:
                i1 = tl.argmax(v, axis=0)
                s = m1 + tl.max(tl.where(offs == i1, float("-inf"), v), axis=0)
            g_score = tl.where(g_offs == g, s, g_score)
        keep = offs < 0
        for _ in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(g_score, axis=0)
            keep = keep | (grp == gi)
            g_score = tl.where(g_offs == gi, float("-inf"), g_score)
        choice = tl.where(keep, choice, float("-inf"))
    k_offs = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    wts = tl.zeros([BLOCK_K], tl.float32)
    for j in tl.static_range(TOP_K):
        i = tl.argmax(choice, axis=0)
        s = tl.sum(tl.where(offs == i, score, 0.0), axis=0)
        ids = tl.where(k_offs == j, i, ids)
        wts = tl.where(k_offs == j, s, wts)
        choice = tl.where(offs == i, float("-inf"), choice)
    mk = k_offs < TOP_K
    if SOFTMAX:                         # softmax over the k chosen logits
        wts = tl.where(mk, tl.exp(wts - tl.max(tl.where(mk, wts, float("-inf")), axis=0)), 0.0)
        wts = wts / tl.sum(wts, axis=0)
    elif RENORM:
        wts = wts / (tl.sum(wts, axis=0) + 1e-20)
    wts = wts * scale
    tl.store(ids_ptr + t * TOP_K + k_offs, ids, mask=mk)
    tl.store(w_ptr + t * TOP_K + k_offs, wts, mask=mk)
    if COUNT:
        one = tl.full([BLOCK_K], 1, tl.int32)
        if HAS_VALID:         # padding tokens add 0 (a value, not a mask: one atomic per choice)
            one = one * (tl.load(valid_ptr + t) != 0).to(tl.int32)
        tl.atomic_add(cnt_ptr + tl.where(mk, ids, 0), tl.where(mk, one, 0))


def route_triton(logits: torch.Tensor, bias: torch.Tensor, spec: RouteSpec, counts: torch.Tensor | None,
                 valid: torch.Tensor | None, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``moe_ops.route`` (ids int32); ``out`` = (ids, weights) to write into."""
    T, E = logits.shape
    k = spec.top_k
    if logits.stride(1) != 1 or E != spec.num_experts:
        raise ValueError(f"logits must be [T, {spec.num_experts}] with a unit inner stride, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if out is None:
        out = (torch.empty(T, k, dtype=torch.int32, device=logits.device),
               torch.empty(T, k, dtype=torch.float32, device=logits.device))
    ids, w = out
    if counts is not None and counts.dtype != torch.int32:
        raise TypeError(f"counts must be int32, got {counts.dtype}")
    _route_kernel[(T,)](
        logits, bias, ids, w, counts if counts is not None else ids, valid if valid is not None else ids,
        E, logits.stride(0), float(spec.scale), TOP_K=k, N_GROUP=spec.n_group,
        PER_GROUP=E // spec.n_group, TOPK_GROUP=spec.topk_group, RENORM=bool(spec.norm_topk_prob),
        COUNT=counts is not None, HAS_VALID=valid is not None, BLOCK_E=next_pow2(E),
        BLOCK_K=max(2, next_pow2(k)), BLOCK_G=max(2, next_pow2(spec.n_group)),
        SOFTMAX=spec.scoring == "softmax", num_warps=_ROUTE_WARPS, **pdl_kwargs(logits.device))
    return ids, w


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, T, E, D, s_xm, s_we, s_om,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          F32_DOTS: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t, e] = sum_d x[t, d] * w[e, d] in float32, x bf16 [T, D], w float32 [E, D] (module
    docstring: three bf16 dots of the weight's parts). F32_DOTS (Triton's interpreter, whose bf16
    ``tl.dot`` is wrong): the same bf16 operands widened to float32 and multiplied in full float32
    precision, the same products (each exact in float32)."""
    z = pdl_enter(PDL)
    offs_m = (tl.program_id(0) + z) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tl.program_id(1) + z) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < T, offs_n < E
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < D
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * s_xm + offs_k[None, :],
                    mask=mm[:, None] & mk[None, :], other=0.0)                               # [BM, BK] bf16
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * s_we + offs_k[:, None],
                    mask=mn[None, :] & mk[:, None], other=0.0)                               # [BK, BN] f32
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        # each K step's three dots start from zero and their sum joins acc in a float32 add: the
        # tensor cores' own accumulation over a whole row (504 MMAs at D 2688) left 2.3e-6 .. 3.3e-6
        # of the |products| sum on the H200, with this add 1.9e-7 .. 2.6e-7 (D 2688 / 4096), as a
        # float32 GEMM's ~1e-7 .. 4e-7 (2026-11-29)
        if F32_DOTS:
            xf = x.to(tl.float32)
            part = tl.dot(xf, hi.to(tl.float32), input_precision="ieee")
            part = tl.dot(xf, mid.to(tl.float32), part, input_precision="ieee")
            part = tl.dot(xf, lo.to(tl.float32), part, input_precision="ieee")
        else:
            part = tl.dot(x, hi)
            part = tl.dot(x, mid, part)
            part = tl.dot(x, lo, part)
        acc += part
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :], acc, mask=mm[:, None] & mn[None, :])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the router's logits kernel by rows x experts, or a fixed
# tuple (tests). H200 sweep (_gpu scratch, 2026-11-29, before the per-step float32 add), us against
# cuBLAS's float32 GEMM: Nano router (128 x 2688) at 512 / 2048 / 8192 rows 33.5 / 35.3 / 91.0 with
# (32, 64, 128, 4), 53.0 / 54.2 / 64.6 with (64, 64, 64, 4), float32 35.7 / 67.0 / 190.1; Super's
# (512 x 4096) at 2048 rows 93.4 with (64, 64, 64, 4), 133.5 with (32, 64, 128, 4), float32 214.2.
# With the per-step add, under this rule (H200, 2026-11-29, do_bench): 38.0 / 39.2 / 63.8 (Nano, float32
# 35.2 / 67.3 / 190.2) and 91.5 (Super, float32 214.9)
ROUTER_TILES = None


def router_tiles(T: int, E: int) -> tuple[int, int, int, int]:
    if ROUTER_TILES is not None:
        return ROUTER_TILES
    return (64, 64, 64, 4) if T * E >= 1 << 20 else (32, 64, 128, 4)


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] bfloat16 @ weight [E, D]^T float32 -> [T, E] float32 (``_router_logits_kernel``);
    checked."""
    if (x.dim() != 2 or weight.dim() != 2 or x.dtype != torch.bfloat16 or weight.dtype != torch.float32
            or x.shape[1] != weight.shape[1] or x.stride(1) != 1 or weight.stride(1) != 1):
        raise ValueError(f"router_logits_triton: needs x [T, D] bfloat16 and weight [E, D] float32 with unit inner "
                         f"strides, got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    T, D = x.shape
    E = weight.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T == 0:
        return out
    bm, bn, bk, warps = router_tiles(T, E)
    _router_logits_kernel[(triton.cdiv(T, bm), triton.cdiv(E, bn))](
        x, weight, out, T, E, D, x.stride(0), weight.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        F32_DOTS=triton_interpreting(), num_warps=warps, **pdl_kwargs(x.device))
    return out
