"""FP8 (float8_e4m3fn) weights: quantization, exact dequantization, and the linear op.

Weights ``w_q`` [N, K] float8_e4m3fn with a float32 ``weight_scale``: [] (per tensor, ModelOpt
FP8) or [N] (per output channel, ``quantization="fp8"`` at load). The real weight is
``w_q.float() * weight_scale`` (per row for [N]).

``fp8_linear(x, w_q, weight_scale, input_scale, bias)`` dispatch (backend logged once per op):
- CUDA, 16-bit or float32 x, at most ``MAX_SKINNY_ROWS`` rows (decode): the Triton kernels of
  ``fp8_kernels`` stream the 1-byte weight and multiply by the scale once per output (weight-only:
  the activations keep their dtype, so decode is at least as exact as W8A8; float32 x is what an
  FP8 drafter of a float32 engine reads, ``SpeculativeConfig(quantization="fp8")``);
- CUDA, bfloat16 x, more rows (prefill) and K, N multiples of 16: ``torch._scaled_mm`` W8A8 on the
  FP8 tensor cores: activations quantized per tensor with the checkpoint's static ``input_scale``,
  or per token (dynamic) when there is none, by one Triton pass (``fp8_quantizer.quantize_rows_fp8``,
  code for code ``quantize_activations``); ``fp8_scaled_mm_ref`` is its twin;
- otherwise (CPU; float32 or float16 rows above ``MAX_SKINNY_ROWS``; bfloat16 with K or N not a
  multiple of 16; no Triton): ``fp8_linear_ref``, exact dequantization then a float32 matmul.
``fp8_linear(..., relu2=True)`` projects relu(x)² (the relu² MLP's down_proj, through
``Fp8Linear.forward_relu2``): the one-row decode kernel and the W8A8 path's quantizer apply relu² as
they read x, so there the relu² output is never written in 16 bits; 2-8 rows run the relu² kernel
before the dot kernel (``fp8_kernels.fp8_skinny_linear_dot`` says why).
``fp8_linear(Fp8Rows, ...)``: rows already quantized by their producer (the block's RMSNorm,
``layers.add_norm_for``; ``takes_fp8_rows`` says when), projected without a quantizer pass; the
projections that share an input (attention's q, k, v) then share one quantization of it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
from hybrid_engine.models.activation import relu2 as relu2_act, relu2_ref

logger = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)        # 448
MAX_SKINNY_ROWS = 8
_SCALED_MM_DTYPES = (torch.bfloat16,)


# per-channel quantization takes this many rows at a time (rows are independent): the float32
# temporaries of a whole 131072 x 4096 lm_head would be 2 GB on the device
QUANT_CHUNK_ROWS = 8192


def quantize_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (w_q [N, K] float8_e4m3fn, scale float32 [] or [N]) with
    scale = amax / 448 (1 for an all-zero tensor/row) and w_q = round(w / scale)."""
    if per_channel and w.shape[0] > QUANT_CHUNK_ROWS:
        w_q = torch.empty(w.shape, dtype=FP8, device=w.device)
        scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        for lo in range(0, w.shape[0], QUANT_CHUNK_ROWS):
            w_q[lo:lo + QUANT_CHUNK_ROWS], scale[lo:lo + QUANT_CHUNK_ROWS] = quantize_fp8(
                w[lo:lo + QUANT_CHUNK_ROWS], per_channel=True)
        return w_q, scale
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1) if per_channel else wf.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    s = scale[:, None] if per_channel else scale
    return (wf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.float()


def dequantize_fp8(w_q: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """-> the weight [N, K] float32, exactly ``w_q * scale`` (per row for a [N] scale)."""
    s = weight_scale.float()
    return w_q.float() * (s[:, None] if s.dim() == 1 else s)


def fp8_linear_ref(x, w_q, weight_scale, bias=None):
    """The exact twin: dequantize in float32, float32 matmul, one rounding to x.dtype."""
    y = F.linear(x.float(), dequantize_fp8(w_q, weight_scale),
                 None if bias is None else bias.float())
    return y.to(x.dtype)


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_q [M, K] float8_e4m3fn, scale float32 [] (static) or [M, 1] (per token))."""
    xf = x.float()
    if input_scale is not None:
        s = input_scale.float()
    else:
        amax = xf.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s


def fp8_scaled_mm_ref(x, w_q, weight_scale, input_scale=None, bias=None):
    """Twin of the W8A8 prefill path: the same activation quantization, float32 arithmetic."""
    x_q, xs = quantize_activations(x, input_scale)
    y = F.linear(x_q.float() * xs, dequantize_fp8(w_q, weight_scale),
                 None if bias is None else bias.float())
    return y.to(x.dtype)


@dataclass(frozen=True)
class Fp8Rows:
    """Activation rows already quantized for the W8A8 path, as ``quantize_rows_fp8`` makes them
    (dynamic per-token scales), handed from their producer to the FP8 projections that read them."""
    codes: torch.Tensor         # [M, K] float8_e4m3fn
    scale: torch.Tensor         # [M, 1] float32, one per token
    dtype: torch.dtype          # the 16-bit dtype of the rows before quantization (and of the outputs)

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape


def _scaled_mm(x_q, xs, w_q, ws, bias, out_dtype):
    """x_q [M, K] x w_q [N, K]^T on the FP8 tensor cores; xs [] or [M, 1], ws [] or [N] float32."""
    M, N = x_q.shape[0], w_q.shape[0]
    if xs.dim() == 0 and ws.dim() == 0:
        y = torch._scaled_mm(x_q, w_q.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype)
    else:
        sa = xs.expand(M, 1).contiguous() if xs.dim() == 0 else xs
        sb = (ws.expand(N) if ws.dim() == 0 else ws).reshape(1, N).contiguous()
        y = torch._scaled_mm(x_q, w_q.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    return y if bias is None else y + bias


def fp8_scaled_mm(x, w_q, weight_scale, input_scale=None, bias=None, *, relu2: bool = False):
    """W8A8 with ``torch._scaled_mm``: tensor-wise scales when both are scalars, row-wise
    ([M, 1] x [1, N]) otherwise. x [M, K] bfloat16, K and N multiples of 16. ``relu2``: the
    projection of relu(x)², the activation applied by the quantizer as it reads x."""
    if x.is_cuda:
        from .fp8_quantizer import quantize_rows_fp8
        x_q, xs = quantize_rows_fp8(x if x.stride(1) == 1 else x.contiguous(), input_scale, relu2=relu2)
    else:
        x_q, xs = quantize_activations(relu2_ref(x) if relu2 else x, input_scale)
    return _scaled_mm(x_q, xs, w_q, weight_scale.float(), bias, x.dtype)


def _path(rows: int, K: int, N: int, dtype: torch.dtype, device: torch.device) -> str:
    """Which kernels ``fp8_linear`` runs for x [rows, K] -> [rows, N]: "skinny", "w8a8" or "ref"."""
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16, torch.float32):
        if rows <= MAX_SKINNY_ROWS and kernel_backend("fp8_skinny_linear", device) == "triton":
            return "skinny"
        if (dtype in _SCALED_MM_DTYPES and K % 16 == 0 and N % 16 == 0
                and kernel_backend("fp8_scaled_mm", device) == "triton"):
            return "w8a8"
    return "ref"


_norm_fusion_logged: set[tuple[str, bool]] = set()


def log_norm_fusion(norm: str, fused: bool, width: int) -> None:
    """Logs once per (norm, outcome) whether ``norm``'s output reaches its FP8 projections as
    quantized rows (``Fp8Rows``) or as 16-bit rows quantized by each projection."""
    if (norm, fused) not in _norm_fusion_logged:
        _norm_fusion_logged.add((norm, fused))
        if fused:
            logger.info("FP8 W8A8 prefill: the %s writes FP8 rows for its projections (width %d)", norm, width)
        else:
            logger.info("FP8 W8A8 prefill: the %s writes 16-bit rows (width %d: no fused FP8 output "
                        "here), each projection quantizes them", norm, width)


def takes_fp8_rows(projections, x: torch.Tensor) -> bool:
    """Whether each of ``projections`` would quantize x [T, K] per token on the W8A8 path, so they
    can all take one ``Fp8Rows`` made by x's producer instead (modules of exactly ``Fp8Linear``
    with no static input scale and no hooks: a hook must see the 16-bit input)."""
    from .linear import Fp8Linear
    if not projections or x.dim() != 2:
        return False
    for p in projections:
        if (type(p) is not Fp8Linear or p.input_scale is not None or p._forward_hooks
                or p._forward_pre_hooks or p.in_features != x.shape[1]
                or _path(x.shape[0], p.in_features, p.out_features, x.dtype, x.device) != "w8a8"):
            return False
    return True


def fp8_linear(x: torch.Tensor | Fp8Rows, w_q: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
               relu2: bool = False) -> torch.Tensor:
    """x [..., K] -> [..., N] in x.dtype (see the module docstring for the paths). ``relu2``: the
    projection of ``activation.relu2(x)``; the one-row decode kernel and the W8A8 path's activation
    quantizer apply it as they read x, the few-row decode path and the CPU reference call ``relu2``
    first. x an ``Fp8Rows`` [M, K] (``takes_fp8_rows`` held for its 16-bit rows): the
    W8A8 product of its codes."""
    N = w_q.shape[0]
    # stored scale shapes [] / [1] (per tensor) and [N] / [N, 1] (per channel) -> [] or [N] (views)
    weight_scale = weight_scale.reshape(()) if weight_scale.numel() == 1 else weight_scale.reshape(-1)
    if isinstance(x, Fp8Rows):
        if input_scale is not None or relu2:
            raise ValueError("fp8_linear: pre-quantized rows carry per-token scales; a static input_scale "
                             "or relu2 cannot apply to them")
        return _scaled_mm(x.codes, x.scale, w_q, weight_scale.float(), bias, x.dtype)
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    path = _path(x2.shape[0], K, N, x2.dtype, x2.device)
    if path == "skinny":
        from .fp8_kernels import fp8_skinny_linear
        y = fp8_skinny_linear(x2.contiguous(), w_q, weight_scale, bias, relu2=relu2)   # relu² on load at one row
        return y.view(*lead, N)
    if path == "w8a8":
        return fp8_scaled_mm(x2, w_q, weight_scale, input_scale, bias, relu2=relu2).view(*lead, N)
    return fp8_linear_ref(relu2_act(x2) if relu2 else x2, w_q, weight_scale, bias).view(*lead, N)
