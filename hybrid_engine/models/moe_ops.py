"""MoE ops: routing, expert dispatch and the torch reference twins of the Triton kernels.

Public ops (each picks its backend through ``kernel_backend`` and logs the choice once):
- ``route(logits, bias, spec, counts, valid)``: ``spec.scoring == "sigmoid"`` (Nemotron-H):
  sigmoid scores, correction bias for the choice only, group-limited top-k, renormalisation,
  ``routed_scaling_factor``; ``"softmax"`` (Granite-4.0-H): top-k of the logits, weights the
  softmax of those k logits -> (ids [T, k] int32, weights [T, k] float32). Optionally adds each valid token's k choices to
  the per-expert counter ``counts`` [E] int32 on the device (the expert-load statistics).
- ``routed_experts(h, w_up, w_down, ids, weights, add, activation)``: sum_j weights[t, j] *
  down[ids[t, j]](act(up[ids[t, j]](h[t]))) [T, D_out] in h's dtype, plus ``add`` when given;
  ``activation`` "relu2" (w_up [E, F, D]) or "swiglu" (w_up [E, 2F, D], gate rows then up rows:
  act = silu(gate) * up, Granite-4.0-H's merged ``input_linear``).
- ``start_beside(side, device)``: side() on a per-device side stream (CUDA) -> a ``SideOutput``
  whose ``wait()`` joins it: the MoE block's shared expert beside its router, routing and routed
  experts (``routed_experts`` takes the handle as ``add`` and joins just before its combine).

Backends: CUDA -> Triton (``triton_moe.py``: fixed-shape, no host sync, CUDA-graph safe; FP8
experts above 8 tokens run W8A8 there, rows quantized per token, twin ``grouped_experts_w8a8_ref``;
NVFP4 experts, given with their block scales, run ``quantization/nvfp4_experts.py``'s kernels); CPU ->
``grouped_experts_ref``, which runs each expert only over the tokens routed to it (the expert
loop reads the per-expert counts on the host, which costs nothing on CPU); CUDA without Triton ->
``dense_experts_ref`` (every expert over every token, weighted; sync-free but E/k times the work).

Numerics follow transformers' NemotronH: router in float32, each expert's up/down projection
rounded to the model dtype, relu² in the model dtype, the routing weight applied in float32 and
the k contributions summed in float32 before one rounding to the model dtype.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend


ROUTER_SCORINGS = ("sigmoid", "softmax")
EXPERT_ACTIVATIONS = ("relu2", "swiglu")


@dataclass(frozen=True)
class RouteSpec:
    """The router's constants (from ModelConfig)."""
    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    scale: float = 1.0
    scoring: str = "sigmoid"          # "sigmoid" | "softmax" (softmax of the k chosen logits)

    def __post_init__(self):
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router scoring must be one of {ROUTER_SCORINGS}, got {self.scoring!r}")
        if self.scoring == "softmax" and self.n_group != 1:
            raise ValueError("the softmax router has no expert groups (n_group must be 1)")
        if self.num_experts % self.n_group:
            raise ValueError(f"n_routed_experts ({self.num_experts}) must be a multiple of n_group "
                             f"({self.n_group})")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, n_group={self.n_group}], got {self.topk_group}")
        if not 1 <= self.top_k <= self.num_experts // self.n_group * self.topk_group:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts // self.n_group * self.topk_group}]"
                             f" (experts in the kept groups), got {self.top_k}")


# ------------------------------------------------------------------------------------- routing

def route_ref(logits: torch.Tensor, bias: torch.Tensor, spec: RouteSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (ids [T, k] int64, weights [T, k] float32); transformers' rule."""
    if spec.scoring == "softmax":             # transformers' GraniteMoeHybridTopKRouter
        top, idx = logits.float().topk(spec.top_k, dim=-1)
        return idx, torch.softmax(top, dim=-1) * spec.scale
    scores = logits.float().sigmoid()                                       # [T, E]
    choice = scores + bias.float()
    per_group = spec.num_experts // spec.n_group
    group_scores = choice.view(-1, spec.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(spec.topk_group, dim=-1, sorted=False)[1]   # [T, topk_group]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, spec.n_group, per_group).reshape(-1, spec.num_experts)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    idx = choice.topk(spec.top_k, dim=-1, sorted=False)[1]                  # [T, k]
    w = scores.gather(1, idx)
    if spec.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * spec.scale


def count_experts_ref(counts: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor | None) -> None:
    """counts[e] += number of valid tokens that chose e (ids [T, k]; valid [T] nonzero = real)."""
    k = ids.shape[1]
    ones = torch.ones(ids.numel(), dtype=counts.dtype, device=counts.device)
    if valid is not None:
        ones = (valid != 0).to(counts.dtype).repeat_interleave(k)
    counts.index_put_((ids.reshape(-1).long(),), ones, accumulate=True)


def route(logits: torch.Tensor, bias: torch.Tensor, spec: RouteSpec, counts: torch.Tensor | None = None,
          valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (ids [T, k], weights [T, k] float32); see the module docstring. ``valid`` [T]: tokens
    whose value is 0 are padding and are not counted (their routing is still computed)."""
    if kernel_backend("moe_route", logits.device) == "triton" and logits.shape[0]:
        from .triton_moe_route import route_triton
        return route_triton(logits, bias, spec, counts, valid)
    ids, w = route_ref(logits, bias, spec)
    if counts is not None:
        count_experts_ref(counts, ids, valid)
    return ids, w


# ------------------------------------------------------------------------- decode-sized linears

DECODE_MAX_TOKENS = 8          # token rows up to which the CUDA decode kernels run


def _rowwise_ok(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= DECODE_MAX_TOKENS and x.stride(-1) == 1
            and all(w.stride(-1) == 1 for w in weights) and kernel_backend("moe_rowwise", x.device) == "triton")


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, D] (model dtype) @ weight [E, D]^T in float32 -> [T, E] float32. On CUDA decode
    batches one kernel reads x in its dtype (no cast kernel); more bf16 rows take the float32
    weight split into three bf16 parts on the tensor cores (``triton_moe_route._router_logits_kernel``:
    float32-class logits: 1.9e-7 .. 2.6e-7 of each logit's |products| sum at the Nano and Super
    widths on an H200, 6.5e-7 at D 80, as a float32 GEMM's 1e-7 .. 4e-7)."""
    if _rowwise_ok(x, weight):
        from .triton_moe import rowwise_linear_triton
        return rowwise_linear_triton(x, weight, out_dtype=torch.float32)
    if (x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.float32 and x.dim() == 2
            and x.stride(-1) == 1 and weight.stride(-1) == 1 and kernel_backend("moe_router", x.device) == "triton"):
        from .triton_moe_route import router_logits_triton
        return router_logits_triton(x, weight)
    return F.linear(x.float(), weight.float())


_AUX_STREAMS: dict[int, "torch.cuda.Stream"] = {}     # one side stream per CUDA device, made on first use


class SideOutput:
    """side()'s output from ``start_beside``: a tensor written on the device's side stream.
    ``wait()`` makes the current stream wait for the side stream (once; later calls only return
    the tensor) and returns the tensor. Every started side output must be waited for before the
    step ends: a CUDA graph capture fails on a fork it never joins."""
    __slots__ = ("_value", "_stream")

    def __init__(self, value: torch.Tensor, stream=None):
        self._value, self._stream = value, stream

    def wait(self) -> torch.Tensor:
        if self._stream is not None:
            cur = torch.cuda.current_stream(self._stream.device)
            cur.wait_stream(self._stream)
            if not _per_stream_pools():
                self._value.record_stream(cur)
            self._stream = None
        return self._value


def joined(add: "torch.Tensor | SideOutput | None") -> torch.Tensor | None:
    """``add`` as a tensor the current stream may read (a ``SideOutput`` is waited for)."""
    return add.wait() if isinstance(add, SideOutput) else add


def start_beside(side, device: torch.device) -> SideOutput:
    """side() on the device's auxiliary stream (CUDA; elsewhere now, on the current stream); the
    current stream goes on at once and joins the side stream at ``SideOutput.wait()``. The MoE
    layer starts its shared expert there and routes, then runs its routed experts: the combine
    waits for the side stream just before it adds the shared output (``joined``). Joined there
    instead of right after the routing, a chain of 8 Nano-width layers in one CUDA graph (H200,
    2026-11-29, benchmarks/results/2026-11-29-moe-late-join-h200.md) took 278 -> 267 us a layer at 8
    tokens, 834 -> 808 at 512 and 1059 -> 1016 at 2048, the same at one token; outputs equal bit for
    bit. Joined after the routing, a layer took 69.6 -> 67.0 us at one token and 205.4 -> 201.5 at
    four against one stream (H100, benchmarks/moe_chain.py --serial, 2026-11-27-moe-shared-beside-h100.md).
    The side stream first waits for the current stream's work so far. No host sync; under
    CUDA-graph capture this is a fork and a join inside the graph.

    side()'s output is not ``record_stream``-ed on the current stream, on purpose: with torch's
    default caching allocator its block belongs to the side stream's pool, and when the current
    stream drops it, the only work that can get that block back is later side-stream work, which
    always starts by waiting for the current stream (``aux.wait_stream(cur)`` before side()
    runs), so it cannot overwrite the block while the current stream still reads it. Blocks the
    current stream allocates while the side stream runs come from its own pool, which the side
    stream never touches; side()'s inputs (x) stay referenced by the caller until the join is in
    the current stream's order. This holds while every caller runs under one current stream, as
    the engine does (a caller on another stream would need a sync between them). A recorded block
    would instead be held until a graph capture ends (each MoE layer's [T, D] output: ~23 T D 2
    bytes more pool for a Nano graph of T rows; 158 -> 86 MiB for 8 Nano-width layers at 2048 rows,
    H100, benchmarks/results/2026-11-27-moe-record-stream-combine-h100.md). Under
    ``PYTORCH_ALLOC_CONF=backend:cudaMallocAsync`` there are no per-stream pools, so there the
    output is recorded at the join (``_per_stream_pools``). Each call makes a few events (host time
    on eager steps). The stream is made on first use, one per device."""
    if device.type != "cuda":
        return SideOutput(side())
    index = device.index if device.index is not None else torch.cuda.current_device()
    aux = _AUX_STREAMS.get(index)
    if aux is None:
        aux = _AUX_STREAMS[index] = torch.cuda.Stream(device=index)
    aux.wait_stream(torch.cuda.current_stream(index))
    with torch.cuda.stream(aux):
        out_side = side()
    return SideOutput(out_side, aux)


@functools.cache
def _per_stream_pools() -> bool:
    """Whether the CUDA allocator keeps a pool per stream (torch's native caching allocator; the
    backend is fixed when CUDA initialises), which ``start_beside`` relies on to skip ``record_stream``."""
    return torch.cuda.memory.get_allocator_backend() == "native"


def shared_expert(x: torch.Tensor, mlp) -> torch.Tensor:
    """The shared relu² MLP (``layers.MLP``); on CUDA decode batches without biases two kernels
    (up with relu² in its epilogue, down) instead of three. Those kernels read the weights as
    values: quantized projections (FP8 / NVFP4 weights with scales) and a drafter's layers with an
    FP8 copy (``spec/drafters/draft_quant.FewRowsFp8``, which picks a side by rows) go through
    their own modules: only plain ``nn.Linear`` projections take the fused path."""
    up, down = mlp.up_proj.weight, mlp.down_proj.weight
    if (isinstance(mlp.up_proj, torch.nn.Linear) and isinstance(mlp.down_proj, torch.nn.Linear)
            and up.dtype == down.dtype == x.dtype and mlp.up_proj.bias is None and mlp.down_proj.bias is None
            and _rowwise_ok(x, up, down)):
        from .triton_moe import rowwise_linear_triton
        return rowwise_linear_triton(rowwise_linear_triton(x, up, relu2=True), down)
    return mlp(x)


# ------------------------------------------------------------------------------------- experts

class ExpertWeights(NamedTuple):
    """What the fused MoE reads: merged weights, and per-expert float32 scales [E] when they are FP8
    or NVFP4 (``weight_scale_2``); NVFP4 weights are packed (two codes a byte) and come with their
    block scales."""
    up: torch.Tensor                   # [E, F, D_in]; NVFP4: [E, F, D_in / 2] uint8
    down: torch.Tensor                 # [E, D_in, F]; NVFP4: [E, D_in, F / 2] uint8
    up_scale: torch.Tensor | None = None       # [E] float32
    down_scale: torch.Tensor | None = None     # [E] float32
    up_blocks: torch.Tensor | None = None      # NVFP4: [E, F, D_in / 16] float8_e4m3fn
    down_blocks: torch.Tensor | None = None    # NVFP4: [E, D_in, F / 16] float8_e4m3fn


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def _act(u: torch.Tensor, activation: str) -> torch.Tensor:
    """The expert activation on the up projection's output (model dtype, as transformers)."""
    if activation == "relu2":
        return _relu2(u)
    gate, up = u.chunk(2, dim=-1)
    return F.silu(gate) * up


def _check_activation(activation: str, w_up: torch.Tensor, w_down: torch.Tensor) -> None:
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"expert activation must be one of {EXPERT_ACTIVATIONS}, got {activation!r}")
    f = w_down.shape[-1]
    if w_up.shape[1] != (2 * f if activation == "swiglu" else f):
        raise ValueError(f"{activation} experts: up {tuple(w_up.shape)} does not fit down {tuple(w_down.shape)}")


def grouped_experts_ref(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
                        weights: torch.Tensor, activation: str = "relu2", *,
                        w8a8_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                        expert_weights=None) -> torch.Tensor:
    """Each expert over the tokens routed to it, in ascending expert order (as transformers):
    h [T, D_in], w_up [E, F, D_in], w_down [E, D_out, F], ids/weights [T, k] -> [T, D_out] h.dtype.
    ``w8a8_scales`` (up, down: [E] float32): the twin of the W8A8 grouped path
    (``grouped_experts_w8a8_ref``); the weights are FP8 codes and each projection's input rows are
    quantized per row. ``expert_weights(e)`` -> (up [F, D_in], down [D_out, F]) in h.dtype: expert e's
    weights made when a token chose it (NVFP4's twin; w_up / w_down then only give E and D_out).
    Reads the per-expert counts on the host (a sync on CUDA: tests and CPU only)."""
    up_scale, down_scale = w8a8_scales if w8a8_scales is not None else (None, None)
    T, k = ids.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)                 # pair indices grouped by expert
    counts = torch.bincount(flat, minlength=w_up.shape[0]).tolist()
    out = torch.zeros(T, w_down.shape[1], dtype=torch.float32, device=h.device)
    w_flat = weights.reshape(-1).float()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        tok = pairs // k
        wu, wd = (w_up[e], w_down[e]) if expert_weights is None else expert_weights(e)
        y = _project(_act(_project(h[tok], wu, up_scale, e), activation), wd, down_scale, e)
        # dtype * float32 -> float32; a token appears once per expert, so this is out[tok] += ...
        # (index_put_ rather than index_add_, which is ~100x slower on CPU for few rows)
        out.index_put_((tok,), y * w_flat[pairs, None], accumulate=True)
        start += n
    return out.to(h.dtype)


def _project(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
    """x [n, K] @ w [N, K]^T in x.dtype. With ``scale`` [E] (W8A8): x quantized per row
    (``fp8.quantize_activations``), the float32 product of the codes times (row scale * scale[e]),
    rounded to x.dtype."""
    if scale is None:
        return F.linear(x, w)
    from hybrid_engine.quantization.fp8 import quantize_activations
    xq, xs = quantize_activations(x, None)                                   # [n, K], [n, 1]
    return (F.linear(xq.float(), w.float()) * (xs * scale[e].float())).to(x.dtype)


def grouped_experts_w8a8_ref(h: torch.Tensor, up_q: torch.Tensor, down_q: torch.Tensor, up_scale: torch.Tensor,
                             down_scale: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                             activation: str = "relu2") -> torch.Tensor:
    """Twin of the W8A8 grouped path (``triton_moe.routed_experts_triton(..., w8a8=True)``): h
    [T, D_in] 16-bit, FP8 experts up_q [E, F, D_in] / down_q [E, D_out, F] with [E] float32 scales.
    ``grouped_experts_ref`` with each projection's input rows quantized per row: the up
    projection rounded to h.dtype, then the activation, quantized again for the down projection,
    weighted and summed over the k choices in float32 -> [T, D_out] h.dtype. Against the kernel
    under the interpreter (exact FP8 dots) only the summation order differs; a Hopper GPU's FP8
    tensor cores also round within each ``PROMOTE_K`` products."""
    return grouped_experts_ref(h, up_q, down_q, ids, weights, activation, w8a8_scales=(up_scale, down_scale))


def dense_experts_ref(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, activation: str = "relu2") -> torch.Tensor:
    """Every expert over every token, weighted by the (mostly zero) dense routing weight: no
    host sync, E/k times the routed work (CUDA without Triton only)."""
    dense_w = torch.zeros(h.shape[0], w_up.shape[0], dtype=torch.float32, device=h.device)
    dense_w.scatter_(1, ids.long(), weights.float())                       # [T, E]
    acc = torch.zeros(h.shape[0], w_down.shape[1], dtype=torch.float32, device=h.device)
    for e in range(w_up.shape[0]):
        acc += F.linear(_act(F.linear(h, w_up[e]), activation), w_down[e]).float() * dense_w[:, e:e + 1]
    return acc.to(h.dtype)


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Merged expert weights [E, N, K] -> ``dtype``; FP8 weights with per-expert float32 scales
    [E] are dequantized exactly in float32 first (the twin of the kernels' scaled epilogue when
    ``dtype`` is float32)."""
    if scale is None:
        return w
    return (w.float() * scale.float()[:, None, None]).to(dtype)


def routed_experts(h: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, add: "torch.Tensor | SideOutput | None" = None, activation: str = "relu2", *,
                   up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                   up_blocks: torch.Tensor | None = None, down_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """[T, D_out] in h.dtype: the routed experts' weighted sum (+ ``add`` [T, D_out], rounded as
    ``routed + add`` in h.dtype). ``up_scale`` / ``down_scale`` [E] float32: the weights are
    float8_e4m3fn and each expert's projection is multiplied by its scale (FP8 experts; the
    reference dequantizes them to h.dtype, float32 on CPU). With ``up_blocks`` / ``down_blocks``
    the weights are NVFP4 (``quantization.nvfp4_experts``; the scales are then the experts'
    ``weight_scale_2``). ``add`` may be a ``SideOutput`` (``start_beside``): the Triton paths wait
    for it just before their combine, the others before they add it."""
    if up_blocks is not None or down_blocks is not None:
        from hybrid_engine.quantization.nvfp4_experts import routed_experts_nvfp4
        return routed_experts_nvfp4(h, w_up, up_blocks, up_scale, w_down, down_blocks, down_scale, ids, weights,
                                    add, activation)
    _check_activation(activation, w_up, w_down)
    backend = kernel_backend("moe_experts", h.device)
    if backend == "triton" and h.shape[0]:
        from .triton_moe import routed_experts_triton
        return routed_experts_triton(h, w_up, w_down, ids, weights, add, activation=activation,
                                     up_scale=up_scale, down_scale=down_scale)
    w_up, w_down = dequantize_experts(w_up, up_scale, h.dtype), dequantize_experts(w_down, down_scale, h.dtype)
    fn = grouped_experts_ref if h.device.type == "cpu" else dense_experts_ref
    out = fn(h, w_up, w_down, ids, weights, activation)
    return out if add is None else out + joined(add)
