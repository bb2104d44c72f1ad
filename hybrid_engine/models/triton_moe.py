"""Triton kernels of the MoE block (CUDA; the torch twins are in ``moe_ops``).

- routing is in ``triton_moe_route.py``.
- decode path (``T <= DECODE_MAX_TOKENS``): ``_pair_gemv_kernel`` computes one (token, choice)
  pair per program row-block, reading only the chosen experts' weights: up (relu² epilogue) into
  [P, F], down into [P, D_out] (the model dtype); no sort.
- grouped path: pairs grouped by expert (``moe_align.group_pairs``: one Triton program for
  decode-sized batches, three launches beyond; fixed-size buffers), then
  ``_grouped_gemm_kernel`` runs one BLOCK_M x BLOCK_N tile of one expert per program with
  ``tl.dot``: up (rows gathered from the tokens, relu², written in sorted order) and down (rows
  in sorted order, written per pair).
- ``rowwise_linear_triton``: the same GEMV kernel on one weight matrix: the router logits (float32
  from a 16-bit x) and the shared expert (relu² epilogue) on decode batches.
- SWIGLU (both expert kernels): the up weight is [E, 2F, D] (gate rows, then up rows); each
  program accumulates the gate and up tiles of its F columns and writes silu(gate) * up.
- ``_combine_kernel``: out[t] = sum_j weight[t, j] * pair_out[t k + j] in float32, rounded to
  the model dtype (+ ``add``). The pair outputs stay in the model dtype, where the reference
  rounds each expert's output before weighting it: half the bytes of weighted float32 pair
  outputs, which the down projection wrote and the combine read (132 MB each at 2048 Nano tokens).
Every buffer has a size fixed by (T, k, E): no host sync, safe inside CUDA graphs.
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import F32_DOT_PRECISION, cdiv
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs

# DECODE_MAX_TOKENS: up to this many tokens the experts run as per-pair GEMVs (no sort)
from .moe_align import align_block_size, group_pairs
from .moe_ops import DECODE_MAX_TOKENS, SideOutput, joined
from .moe_tiles import gemm_config, gemv_tiles, max_shared_mem

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ experts

@triton.jit
def _swiglu(g, u, dtype):
    """silu(g) * u as transformers computes it in the model dtype: g and u are the projections
    (g already rounded), silu(g) rounded, the product rounded at the store."""
    u = u.to(dtype).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return s * u


@triton.jit
def _expert_epilogue(y, up, DT: tl.constexpr, RELU2: tl.constexpr, SWIGLU: tl.constexpr, ROUND: tl.constexpr = True):
    """Every expert kernel's epilogue on its float32 sums (scales applied): the projection rounded
    to the model dtype DT (as F.linear; ROUND False keeps float32: the router logits), relu²
    squaring that in float32 (exact) for one more rounding at the store, or silu(gate) rounded
    times up (``_swiglu``; ``up``: the up rows' sums, unused otherwise). The routing weight is the
    combine's: a down projection's rounded output is exact in the model dtype."""
    if ROUND:
        y = y.to(DT).to(tl.float32)
    if RELU2:
        y = tl.where(y < 0.0, 0.0, y)
        y = y * y
    if SWIGLU:
        y = _swiglu(y, up, DT)
    return y


@triton.jit
def _pair_gemv_kernel(a_ptr, w_ptr, ids_ptr, out_ptr, N, K, A_DIV, s_am, s_we, s_wn, s_om,
                      RELU2: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ONE_WEIGHT: tl.constexpr = False, ROUND: tl.constexpr = True,
                      SWIGLU: tl.constexpr = False, ws_ptr=None, W_SCALED: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    """out[p, n] = epilogue(sum_k a[p // A_DIV, k] * w[ids[p], n, k]); one pair per grid row.
    ONE_WEIGHT: w is one [N, K] matrix (ids not read): a plain row-wise linear (shared expert,
    router logits); ROUND False keeps the float32 sum (router logits). SWIGLU: w has 2N rows
    (gate rows n, up rows N + n): out = silu(gate) * up. W_SCALED: w is FP8 and the sum is
    multiplied by the expert's float32 scale ``ws[e]`` before the epilogue. PDL: launched with
    programmatic dependent launch (``triton_pdl``)."""
    z = pdl_enter(PDL)
    pid_n = tl.program_id(0) + z
    p = tl.program_id(1) + z
    if ONE_WEIGHT:
        e = pid_n.to(tl.int64) * 0
    else:
        e = tl.load(ids_ptr + p).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    w_rows = w_ptr + e * s_we + offs_n[:, None].to(tl.int64) * s_wn
    a_row = a_ptr + (p // A_DIV).to(tl.int64) * s_am
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        wt = tl.load(w_rows + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
        xv = tl.load(a_row + offs_k, mask=mk, other=0.0)
        acc += wt.to(tl.float32) * xv.to(tl.float32)[None, :]
        if SWIGLU:
            wu = tl.load(w_rows + N * s_wn + offs_k[None, :], mask=mn[:, None] & mk[None, :], other=0.0)
            acc_up += wu.to(tl.float32) * xv.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    up = tl.sum(acc_up, axis=1)
    if W_SCALED:
        y = y * tl.load(ws_ptr + e)
        up = up * tl.load(ws_ptr + e)
    y = _expert_epilogue(y, up, a_ptr.dtype.element_ty, RELU2, SWIGLU, ROUND)
    tl.store(out_ptr + p.to(tl.int64) * s_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mn)


def rowwise_linear_triton(x: torch.Tensor, weight: torch.Tensor, relu2: bool = False,
                          out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, K] @ weight[N, K]^T for a few rows in one launch (the decode path's shared expert and
    router): out_dtype None -> x.dtype, rounded as F.linear (then relu² if asked); float32 with
    a 16-bit x keeps the float32 sum (router logits from float32 router weights)."""
    T, K = x.shape
    N = weight.shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    out = torch.empty(T, N, dtype=out_dtype, device=x.device)
    bn, bk, warps = gemv_tiles("rowwise", T, weight)
    _pair_gemv_kernel[(cdiv(N, bn), T)](
        x, weight, x, out, N, K, 1, x.stride(0), 0, weight.stride(0), out.stride(0),
        RELU2=relu2, BLOCK_N=bn, BLOCK_K=bk, ONE_WEIGHT=True,
        ROUND=out_dtype == x.dtype, num_warps=warps, ws_ptr=x, **pdl_kwargs(x.device))
    return out


@triton.jit
def _expert_tile_rows(sorted_ptr, block_e_ptr, pid_m, num_pairs, A_DIV, A_SORTED: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    """A grouped-GEMM tile's rows (every grouped expert kernel): its expert, sorted positions
    [BLOCK_M], their pair ids (num_pairs on padding rows), the real-row mask, and the A rows
    (the sorted position with A_SORTED, else the pair's token, pair // A_DIV)."""
    e = tl.load(block_e_ptr + pid_m).to(tl.int64)
    pos = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + pos)
    mrow = pair < num_pairs
    if A_SORTED:
        a_rows = pos.to(tl.int64)
    else:
        a_rows = (pair // A_DIV).to(tl.int64)
    return e, pos, pair, mrow, a_rows


@triton.jit
def _store_expert_tile(out_ptr, y, pos, pair, mrow, offs_n, mn, s_om, OUT_SORTED: tl.constexpr):
    """A grouped-GEMM tile's output y [BLOCK_M, BLOCK_N] float32 (exact in out's dtype), stored at
    the sorted position (OUT_SORTED) or the pair id."""
    if OUT_SORTED:
        o_rows = pos.to(tl.int64)
    else:
        o_rows = pair.to(tl.int64)
    tl.store(out_ptr + o_rows[:, None] * s_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mrow[:, None] & mn[None, :])


@triton.jit(do_not_specialize=["num_pairs"],
            do_not_specialize_on_alignment=["sorted_ptr", "block_e_ptr", "nrows_ptr"])
def _grouped_gemm_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_e_ptr, nrows_ptr,
                         N, K, num_pairs, A_DIV, s_am, s_we, s_wn, s_om,
                         A_SORTED: tl.constexpr, OUT_SORTED: tl.constexpr, RELU2: tl.constexpr,
                         F32: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ws_ptr,
                         SWIGLU: tl.constexpr = False, W_SCALED: tl.constexpr = False,
                         as_ptr=None, A_SCALED: tl.constexpr = False, MODEL_BF16: tl.constexpr = False,
                         PROMOTE_K: tl.constexpr = 32, F32_PREC: tl.constexpr = F32_DOT_PRECISION):
    """One BLOCK_M x BLOCK_N tile of one expert's projection over its sorted pair rows.
    A rows: the sorted position (A_SORTED) or the pair's token (pair // A_DIV); output rows: the
    sorted position (OUT_SORTED) or the pair id. Tiles past the used rows exit at once.
    A_SCALED (W8A8, with W_SCALED): A holds float8_e4m3fn codes with one float32 scale per A row
    (``as_ptr``, indexed like the A rows); the dot runs on FP8 operands (the FP8 tensor cores) and
    the sum is multiplied by (row scale * expert scale); the epilogue then rounds to bfloat16
    (MODEL_BF16) or float16, the model's dtype (otherwise to A's). The FP8 tensor cores of a
    Hopper GPU keep fewer bits than float32 while they accumulate (Triton lets them run a whole K
    that way by default on sm_90: a 1e-2 relative error against float32 sums at Nano widths, H200,
    2026-11-29); the dot's partial sum is added into the float32 accumulator every PROMOTE_K
    products (a multiple of 32, at most BLOCK_K), as cuBLAS's FP8 GEMM does without fast
    accumulation."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(nrows_ptr):
        return
    e, pos, pair, mrow, a_rows = _expert_tile_rows(sorted_ptr, block_e_ptr, pid_m, num_pairs, A_DIV, A_SORTED,
                                                   BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = offs_n < N
    a_base = a_ptr + a_rows[:, None] * s_am
    w_base = w_ptr + e * s_we + offs_n[None, :].to(tl.int64) * s_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < K
        a = tl.load(a_base + offs_k[None, :], mask=mrow[:, None] & mk[None, :], other=0.0)   # [BM, BK]
        w = tl.load(w_base + offs_k[:, None], mask=mk[:, None] & mn[None, :], other=0.0)      # [BK, BN]
        if W_SCALED and not A_SCALED:   # FP8 weight tile -> the activations' dtype (exact)
            w = w.to(a_ptr.dtype.element_ty)
        if A_SCALED:
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=PROMOTE_K)
        elif F32:                       # float32 operands (triton_common.F32_DOT_PRECISION)
            acc = tl.dot(a, w, acc, input_precision=F32_PREC)
        else:
            acc = tl.dot(a, w, acc)
        if SWIGLU:                      # the up rows sit N rows below the gate rows
            wu = tl.load(w_base + N * s_wn + offs_k[:, None], mask=mk[:, None] & mn[None, :], other=0.0)
            if W_SCALED and not A_SCALED:
                wu = wu.to(a_ptr.dtype.element_ty)
            if A_SCALED:
                acc_up = tl.dot(a, wu, acc_up, max_num_imprecise_acc=PROMOTE_K)
            elif F32:
                acc_up = tl.dot(a, wu, acc_up, input_precision=F32_PREC)
            else:
                acc_up = tl.dot(a, wu, acc_up)
    if A_SCALED:                        # one scale per row: the token's (or sorted row's) times the expert's
        scale = tl.load(as_ptr + a_rows, mask=mrow, other=0.0)[:, None] * tl.load(ws_ptr + e)
        acc = acc * scale
        if SWIGLU:
            acc_up = acc_up * scale
        if MODEL_BF16:
            out_ty = tl.bfloat16
        else:
            out_ty = tl.float16
    else:
        if W_SCALED:
            acc = acc * tl.load(ws_ptr + e)
            if SWIGLU:
                acc_up = acc_up * tl.load(ws_ptr + e)
        out_ty = a_ptr.dtype.element_ty
    y = _expert_epilogue(acc, acc_up, out_ty, RELU2, SWIGLU)
    _store_expert_tile(out_ptr, y, pos, pair, mrow, offs_n, mn, s_om, OUT_SORTED)


@triton.jit
def _combine_kernel(pair_ptr, wt_ptr, add_ptr, out_ptr, N, TOP_K, HAS_ADD: tl.constexpr, BLOCK_N: tl.constexpr,
                    PDL: tl.constexpr = False):
    """out[t] = sum_j wt[t, j] * pair[t k + j] in float32, rounded once (+ add). Launched with
    ``COMBINE_LAUNCH`` (no FP fusion): each product is rounded on its own before the add, as the
    reference (``grouped_experts_ref``: y * w, then the sum) and as when the down kernel stored
    weighted float32 pair outputs; a fused multiply-add would skip that rounding."""
    z = pdl_enter(PDL)
    t = (tl.program_id(0) + z).to(tl.int64)
    offs = (tl.program_id(1) + z) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = offs < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in range(TOP_K):
        acc += tl.load(pair_ptr + (t * TOP_K + j) * N + offs, mask=m, other=0.0).to(tl.float32) * \
            tl.load(wt_ptr + t * TOP_K + j)
    y = acc
    if HAS_ADD:       # routed + shared in the model dtype: round each, add, round again
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + tl.load(add_ptr + t * N + offs, mask=m,
                                                                        other=0.0).to(tl.float32)
    tl.store(out_ptr + t * N + offs, y.to(out_ptr.dtype.element_ty), mask=m)


# the combine's launch options: its products and adds stay separate float32 operations (Triton
# fuses them into fma.rn.f32 by default, which changed ~45% of the float32 sums in their last bits)
COMBINE_LAUNCH = dict(num_warps=4, enable_fp_fusion=False)


def _check(h, w_up, w_down, ids, weights, swiglu: bool = False):
    E, F, D_in = w_up.shape
    F = F // 2 if swiglu else F
    if h.dim() != 2 or h.shape[1] != D_in or w_down.shape[0] != E or w_down.shape[2] != F:
        raise ValueError(f"routed experts: h {tuple(h.shape)}, up {tuple(w_up.shape)}, down "
                         f"{tuple(w_down.shape)} must be [T, D], [E, F, D], [E, D_out, F]")
    if ids.shape != weights.shape or ids.shape[0] != h.shape[0]:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be [T, k]")
    if w_up.stride(-1) != 1 or w_down.stride(-1) != 1 or h.stride(-1) != 1:
        raise ValueError("routed experts: weights and h need a unit inner stride")


_W8A8_DTYPES = (torch.bfloat16, torch.float16)       # the rows' dtypes of the W8A8 grouped path
_w8a8_logged: set[tuple[bool, str]] = set()


def _w8a8_wanted(w8a8: bool | None, fp8_weights: bool, dtype: torch.dtype) -> bool:
    """Whether the grouped path runs W8A8 (see ``routed_experts_triton``); the outcome is
    logged once per (outcome, dtype). Asking for it where it cannot run is a ValueError."""
    possible = fp8_weights and dtype in _W8A8_DTYPES
    if w8a8 and not possible:
        raise ValueError(f"routed experts: w8a8 needs FP8 expert weights and bfloat16 / float16 rows, got "
                         f"{'FP8' if fp8_weights else 'unquantized'} weights and {dtype}")
    use = possible if w8a8 is None else bool(w8a8)
    if fp8_weights and (use, str(dtype)) not in _w8a8_logged:
        _w8a8_logged.add((use, str(dtype)))
        logger.info("FP8 experts (%s rows) above %d tokens: %s", dtype, DECODE_MAX_TOKENS,
                    "W8A8 grouped GEMM (rows quantized per token, FP8 tensor cores)" if use
                    else "weight-only grouped GEMM (FP8 weight tiles converted to the rows' dtype)")
    return use


def routed_experts_triton(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
                          weights: torch.Tensor, add: "torch.Tensor | SideOutput | None" = None,
                          force_grouped: bool = False, out: torch.Tensor | None = None,
                          activation: str = "relu2", *, up_scale: torch.Tensor | None = None,
                          down_scale: torch.Tensor | None = None, w8a8: bool | None = None) -> torch.Tensor:
    """Same contract as ``moe_ops.routed_experts``. ``force_grouped`` (tests, benchmarks) takes
    the grouped path whatever the token count; ``out`` [T, D_out] h.dtype to write into.
    ``up_scale`` / ``down_scale`` [E] float32: FP8 weights, scaled per expert in the epilogue.
    ``w8a8`` (FP8 weights, 16-bit h, grouped path; None: on there): each projection's input rows
    are quantized to FP8 per row (``fp8_quantizer.quantize_rows_fp8``) and the grouped GEMM runs
    on FP8 operands, as the FP8 linears' prefill path does (twin: ``moe_ops.grouped_experts_w8a8_ref``);
    False keeps the weight-only path (FP8 weight tiles converted to h's dtype)."""
    swiglu = activation == "swiglu"
    _check(h, w_up, w_down, ids, weights, swiglu)
    if (up_scale is None) != (down_scale is None):
        raise ValueError("routed experts: give both up_scale and down_scale or neither")
    w8a8 = _w8a8_wanted(w8a8, up_scale is not None, h.dtype)
    scaled = dict(W_SCALED=up_scale is not None)
    T, k = ids.shape
    E, F, _ = w_up.shape
    F = F // 2 if swiglu else F                  # the activation's width (SwiGLU: half the up rows)
    D_out = w_down.shape[1]
    P = T * k
    dev = h.device
    ids, weights, pair_out = pair_buffers(ids, weights, D_out, h.dtype)
    pdl = pdl_kwargs(dev)
    if T <= DECODE_MAX_TOKENS and not force_grouped:
        inter = torch.empty(P, F, dtype=h.dtype, device=dev)                  # relu²(up) per pair
        bn, bk, warps = gemv_tiles("up", T, w_up)
        _pair_gemv_kernel[(cdiv(F, bn), P)](
            h, w_up, ids, inter, F, h.shape[1], k, h.stride(0), w_up.stride(0), w_up.stride(1),
            inter.stride(0), RELU2=not swiglu, BLOCK_N=bn, BLOCK_K=bk, SWIGLU=swiglu,
            num_warps=warps, ws_ptr=up_scale if up_scale is not None else weights, **scaled, **pdl)
        bn, bk, warps = gemv_tiles("down", T, w_down)
        _pair_gemv_kernel[(cdiv(D_out, bn), P)](
            inter, w_down, ids, pair_out, D_out, F, 1, inter.stride(0), w_down.stride(0),
            w_down.stride(1), pair_out.stride(0), RELU2=False, BLOCK_N=bn, BLOCK_K=bk,
            num_warps=warps, ws_ptr=down_scale if down_scale is not None else weights, **scaled, **pdl)
    else:
        bm = align_block_size(P, E, w8a8)
        al = group_pairs(ids, E, bm)
        cfg = gemm_config(bm, h.dtype, swiglu, smem_bytes=device_smem(dev), w8a8=w8a8)
        inter = torch.empty(al.sorted_pairs.shape[0], F, dtype=h.dtype, device=dev)   # sorted rows
        f32 = h.dtype == torch.float32
        a_up, a_up_scale = h, None
        if w8a8:
            from hybrid_engine.quantization.fp8_quantizer import quantize_rows_fp8
            a_up, a_up_scale = quantize_rows_fp8(h)                      # [T, D] codes, [T, 1] scales
            scaled.update(A_SCALED=True, MODEL_BF16=h.dtype == torch.bfloat16)
        _grouped_gemm_kernel[(cdiv(F, cfg["BLOCK_N"]), al.max_blocks)](
            a_up, w_up, inter, al.sorted_pairs, al.block_expert, al.num_rows,
            F, h.shape[1], P, k, a_up.stride(0), w_up.stride(0), w_up.stride(1), inter.stride(0),
            A_SORTED=False, OUT_SORTED=True, RELU2=not swiglu, F32=f32, BLOCK_M=bm,
            SWIGLU=swiglu, ws_ptr=up_scale if up_scale is not None else weights, as_ptr=a_up_scale,
            **scaled, **cfg)
        a_down, a_down_scale = inter, None
        if w8a8:        # the activation's rows in sorted order; the padding rows past num_rows are skipped
            a_down, a_down_scale = quantize_rows_fp8(inter, rows_in_use=al.num_rows)
        _grouped_gemm_kernel[(cdiv(D_out, cfg["BLOCK_N"]), al.max_blocks)](
            a_down, w_down, pair_out, al.sorted_pairs, al.block_expert, al.num_rows,
            D_out, F, P, 1, a_down.stride(0), w_down.stride(0), w_down.stride(1), pair_out.stride(0),
            A_SORTED=True, OUT_SORTED=False, RELU2=False, F32=f32, BLOCK_M=bm,
            ws_ptr=down_scale if down_scale is not None else weights, as_ptr=a_down_scale, **scaled, **cfg)
    return combine_pairs(pair_out, weights, h.dtype, add, out)


def pair_buffers(ids: torch.Tensor, weights: torch.Tensor, d_out: int, dtype: torch.dtype):
    """-> (ids, weights as float32, pair_out [T k, d_out] in ``dtype``, the model's): the expert
    kernels' contiguous choices and the per-pair down outputs they write (``combine_pairs``
    weights and sums them)."""
    pair_out = torch.empty(ids.numel(), d_out, dtype=dtype, device=ids.device)
    return ids.contiguous(), weights.contiguous().float(), pair_out


def device_smem(dev: torch.device) -> int | None:
    """Shared memory per block of a CUDA device (None elsewhere: no limit on the tiles)."""
    if dev.type != "cuda":
        return None
    return max_shared_mem(dev.index if dev.index is not None else torch.cuda.current_device())


def combine_pairs(pair_out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype,
                  add: "torch.Tensor | SideOutput | None" = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """pair_out [T k, D_out] (each pair's down output) and weights [T, k] float32 -> out [T, D_out]
    in ``dtype``: each token's k pairs weighted and summed in float32, rounded once (+ ``add``
    [T, D_out], rounded as routed + add; a ``SideOutput`` is waited for here, so the shared
    expert's side stream overlaps the experts)."""
    add = joined(add)
    T, k = weights.shape
    D_out = pair_out.shape[1]
    if out is None:
        out = torch.empty(T, D_out, dtype=dtype, device=pair_out.device)
    if add is not None and (add.shape != out.shape or not add.is_contiguous()):
        raise ValueError(f"add must be a contiguous [{T}, {D_out}] tensor, got {tuple(add.shape)}")
    bn = 256
    _combine_kernel[(T, cdiv(D_out, bn))](pair_out, weights, add if add is not None else out, out, D_out, k,
                                          HAS_ADD=add is not None, BLOCK_N=bn, **COMBINE_LAUNCH,
                                          **pdl_kwargs(pair_out.device))
    return out
