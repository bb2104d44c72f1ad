"""Quantized linear layers and the factory that puts them in a model.

A quantization method plugs in as a module class registered in ``LINEAR_METHODS`` by (method,
source); ``quantize_linears`` swaps the model's ``Linear`` layers for it, one module at a time, and
logs the choice and the kernels once. Nothing else in the model, runner or caches knows about
quantization: the swapped modules keep the checkpoint names (``<layer>.weight``, ``.weight_scale``,
``.input_scale``, ``.weight_scale_2``), so the loader fills them like any tensor.

- source "checkpoint": the modules are created empty (on the meta device, before the model is
  materialised) for exactly the layers the checkpoint stores quantized (``stored_quantized``);
  the scale shapes are taken from the file (per tensor [] / [1], or per channel [N] / [N, 1]).
- routed experts: ``Experts`` modules whose every expert is stored in FP8 / NVFP4 become
  ``experts.Fp8Experts`` / ``experts.Nvfp4Experts``, which the fused MoE kernels read as stored
  (online FP8 and NVFP4 quantize them per expert too).
- source "online": after a 16/32-bit checkpoint is loaded, each ``Linear`` not excluded is
  quantized in place (FP8: per-output-channel scales; NVFP4: 16-element blocks), freeing its
  16-bit weight before the next layer, so the peak stays one layer above the quantized model.

Quantized storage keeps its dtype whatever the model is cast to (``QuantLinear._apply``), and the
loader does not cast names listed in ``fixed_dtype_params``.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from .config import QuantConfig
from .fp8 import FP8, fp8_linear, quantize_fp8
from .nvfp4 import GROUP, nvfp4_linear, quantize_nvfp4

logger = logging.getLogger(__name__)

# checkpoint tensors of ModelOpt exports the weight loader reads past: the FP8 KV-cache scales of the
# attention layers, which belong to the KV cache (kv_scales.py reads them when kv_cache_dtype="fp8")
IGNORED_SUFFIXES = (".k_scale", ".v_scale")
_KERNELS = {
    "fp8": "decode (<= 8 rows): Triton FP8-weight skinny kernels (bf16/fp16 compute); prefill: "
           "torch._scaled_mm W8A8 (bf16, K and N multiples of 16); routed experts: the fused MoE "
           "kernels with per-expert scales (weight-only up to 8 tokens, W8A8 above with bf16/fp16 rows); "
           "otherwise / CPU: exact dequantize reference",
    "nvfp4": "decode (<= 128 rows): Triton NVFP4 weight-only kernel (bf16/fp16 compute); prefill: "
             "dequantize to 16 bits + cuBLAS; routed experts: the fused MoE kernels decoding the packed "
             "weights (per-pair GEMVs up to 24 tokens, grouped GEMM on 16-bit tiles above); CPU: exact "
             "dequantize reference",
}


def _empty(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class QuantLinear(nn.Module):
    """Base of the quantized layers: ``fixed_dtype_params`` keep their dtype through ``.to(dtype)``
    / ``.float()`` (only moved between devices); the loader does not cast them either."""
    fixed_dtype_params: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        fixed = {n: p for n, p in self._parameters.items() if n in self.fixed_dtype_params and p is not None}
        for n in fixed:
            self._parameters[n] = None
        super()._apply(fn, recurse)
        with torch.no_grad():
            for n, p in fixed.items():
                new = fn(p)
                if new.dtype != p.dtype:      # a dtype cast: keep the storage dtype, follow the device
                    new = torch.empty_like(p, device=new.device) if p.is_meta else p.to(new.device)
                self._parameters[n] = nn.Parameter(new, requires_grad=False)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Fp8Linear(QuantLinear):
    """weight [N, K] float8_e4m3fn, weight_scale float32 (per tensor or per channel), optional
    static input_scale [] float32 (used by the W8A8 prefill path), optional bias."""
    fixed_dtype_params = ("weight", "weight_scale", "input_scale")
    # its forward takes ``fp8.Fp8Rows`` (rows its producer quantized; ``fp8.takes_fp8_rows``): the
    # norms check this first, so models without FP8 layers skip the rest of the test
    accepts_fp8_rows = True

    def __init__(self, in_features: int, out_features: int, *, bias: bool, scale_shape=(),
                 input_scale: bool = False, dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty((out_features, in_features), FP8, device)
        self.weight_scale = _empty(tuple(scale_shape), torch.float32, device)
        self.input_scale = _empty((), torch.float32, device) if input_scale else None
        self.bias = _empty((out_features,), dtype or torch.get_default_dtype(), device) if bias else None

    @classmethod
    def quantized_from(cls, lin: nn.Linear, per_channel: bool = True) -> "Fp8Linear":
        w_q, scale = quantize_fp8(lin.weight, per_channel)
        m = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, scale_shape=scale.shape,
                dtype=lin.weight.dtype, device=lin.weight.device)
        with torch.no_grad():
            m.weight.copy_(w_q)
            m.weight_scale.copy_(scale)
            if lin.bias is not None:
                m.bias.copy_(lin.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)

    def forward_relu2(self, x: torch.Tensor) -> torch.Tensor:
        """``self(relu2(x))`` (``layers.project_relu2``): the W8A8 prefill path applies relu² in
        its activation quantizer, so the activation is never written in 16 bits."""
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias, relu2=True)


class Nvfp4Linear(QuantLinear):
    """weight [N, K/2] uint8 (packed e2m1), weight_scale [N, K/16] float8_e4m3fn, weight_scale_2
    [] float32, optional input_scale [] float32 (loaded, unused: weight-only), optional bias."""
    fixed_dtype_params = ("weight", "weight_scale", "weight_scale_2", "input_scale")

    def __init__(self, in_features: int, out_features: int, *, bias: bool, input_scale: bool = False,
                 dtype=None, device=None):
        super().__init__()
        if in_features % GROUP:
            raise ValueError(f"NVFP4 needs in_features to be a multiple of {GROUP}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty((out_features, in_features // 2), torch.uint8, device)
        self.weight_scale = _empty((out_features, in_features // GROUP), FP8, device)
        self.weight_scale_2 = _empty((), torch.float32, device)
        self.input_scale = _empty((), torch.float32, device) if input_scale else None
        self.bias = _empty((out_features,), dtype or torch.get_default_dtype(), device) if bias else None

    @classmethod
    def quantized_from(cls, lin: nn.Linear) -> "Nvfp4Linear":
        packed, bs, gs = quantize_nvfp4(lin.weight)
        m = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, dtype=lin.weight.dtype,
                device=lin.weight.device)
        with torch.no_grad():
            m.weight.copy_(packed)
            m.weight_scale.copy_(bs)
            m.weight_scale_2.copy_(gs)
            if lin.bias is not None:
                m.bias.copy_(lin.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nvfp4_linear(x, self.weight, self.weight_scale, self.weight_scale_2, self.bias)

    def forward_relu2(self, x: torch.Tensor) -> torch.Tensor:
        """``self(relu2(x))`` (``layers.project_relu2``): the one-row decode kernel applies relu² as
        it loads x, so a batch-1 decode step has no relu² launch."""
        return nvfp4_linear(x, self.weight, self.weight_scale, self.weight_scale_2, self.bias, relu2=True)


# ------------------------------------------------------------------------------------ the factory

def _fp8_empty(lin: nn.Linear, stored: dict) -> Fp8Linear:
    return Fp8Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                     scale_shape=stored.get("weight_scale", ()), input_scale="input_scale" in stored,
                     dtype=lin.weight.dtype, device=lin.weight.device)


def _nvfp4_empty(lin: nn.Linear, stored: dict) -> Nvfp4Linear:
    return Nvfp4Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                       input_scale="input_scale" in stored, dtype=lin.weight.dtype, device=lin.weight.device)


_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.\d+\.(up_proj|down_proj)$")


def _expert_class(method: str):
    """The quantized experts' module class of ``method`` (imported on use: experts.py imports this module)."""
    from .experts import Fp8Experts, Nvfp4Experts
    return {"fp8": Fp8Experts, "nvfp4": Nvfp4Experts}[method]


def _quantize_experts(model: nn.Module, q: QuantConfig) -> list[str]:
    """Online: each ``Experts`` module not excluded quantized per expert (its 16-bit weights freed
    module by module); NVFP4 experts whose widths are not multiples of 16 stay 16-bit (logged)."""
    from hybrid_engine.models.moe import Experts
    quantized, names = _expert_class(q.method), []
    for name in [n for n, m in model.named_modules() if isinstance(m, Experts) and not q.excluded(n)]:
        experts = model.get_submodule(name)
        if q.method == "nvfp4" and not quantized.fits(experts):
            logger.info("%s stays 16-bit: NVFP4 needs the experts' widths %s to be multiples of %d", name,
                        tuple(experts.up_proj.shape[1:]), GROUP)
            continue
        _swap(model, name, quantized.quantized_from(experts))
        names.append(name)
    return names


# (method, source) -> builder(linear, stored tensor shapes {suffix: shape}) -> module
LINEAR_METHODS = {
    ("fp8", "checkpoint"): _fp8_empty,
    ("fp8", "online"): lambda lin, stored: Fp8Linear.quantized_from(lin, per_channel=True),
    ("nvfp4", "checkpoint"): _nvfp4_empty,
    ("nvfp4", "online"): lambda lin, stored: Nvfp4Linear.quantized_from(lin),
}
# the on-disk dtype of a quantized weight, per method (safetensors codes)
STORED_WEIGHT_DTYPE = {"fp8": "F8_E4M3", "nvfp4": "U8"}


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _experts_from_checkpoint(model: nn.Module, rest: list[str], stored: dict, method: str) -> list[str]:
    """Swap each ``Experts`` whose every expert is stored in ``method`` for its quantized module
    (``_expert_class``); the experts' input scales are read past (weight-only). -> the swapped
    module names."""
    from hybrid_engine.models.moe import Experts
    quantized = _expert_class(method)
    by_parent: dict[str, set[str]] = {}
    for m in rest:
        by_parent.setdefault(_EXPERT.match(m)["p"], set()).add(m)
    swapped, ignored = [], set()
    for parent, mods in by_parent.items():
        try:
            experts = model.get_submodule(parent)
        except AttributeError:
            experts = None
        if not isinstance(experts, Experts):
            raise ValueError(f"the checkpoint stores quantized experts under {parent}, which is not a routed-"
                             "experts module of this model")
        E = experts.up_proj.shape[0]
        want = {f"{parent}.{e}.{w}" for e in range(E) for w in ("up_proj", "down_proj")}
        if mods != want:
            raise ValueError(f"{parent}: {len(mods)} of the {len(want)} expert projections are stored in "
                             f"{method} (e.g. {sorted(want - mods)[0]} is not); mixed experts are not implemented")
        _swap(model, parent, quantized.like(experts))
        swapped.append(parent)
        ignored |= {f"{m}.input_scale" for m in mods if "input_scale" in stored[m]}
    model.ignored_checkpoint_names = frozenset(ignored)
    return swapped


def quantize_linears(model: nn.Module, q: QuantConfig, stored: dict[str, dict] | None = None) -> list[str]:
    """Swap ``model``'s linear layers for ``q``'s modules; returns the swapped module names.

    ``stored`` (source "checkpoint"): {module name: {tensor suffix: shape}} of the layers the
    checkpoint stores quantized; exactly those are swapped. Source "online": every ``nn.Linear``
    whose name ``q`` does not exclude (a weight shared with the embeddings stays 16-bit).

    Online, the 16-bit model is on the device: each layer's 16-bit module is freed as soon as its
    quantized one replaces it (the loops hold names, not modules), so the peak stays the 16-bit
    weights plus one layer's worth, not the 16-bit and quantized models together (the full
    Nano-30B-A3B, 63 GB in bf16, ran out of memory on an 80 GB H100 that way)."""
    build = LINEAR_METHODS[(q.method, q.source)]
    shared = {id(p) for n, p in model.named_parameters() if n.endswith("embeddings.weight")}
    names = []
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, QuantLinear)]
    for name in linears:
        mod = model.get_submodule(name)
        if stored is not None:
            if name not in stored:
                continue
        elif q.excluded(name) or id(mod.weight) in shared:
            continue
        elif q.method == "nvfp4" and mod.in_features % GROUP:
            logger.info("%s stays 16-bit: NVFP4 needs in_features (%d) to be a multiple of %d", name,
                        mod.in_features, GROUP)
            continue
        new = build(mod, (stored or {}).get(name, {}))
        del mod                                   # the last reference besides the parent's
        _swap(model, name, new)
        names.append(name)
    if stored is not None:
        rest = sorted(set(stored) - set(names))
        not_experts = [m for m in rest if not _EXPERT.match(m)]
        if not_experts:
            raise ValueError(f"the checkpoint stores {len(not_experts)} quantized module(s) that are not linear "
                             f"layers or routed experts of this model, e.g. {not_experts[0]}; quantizing them "
                             "is not implemented")
        if rest:
            names += _experts_from_checkpoint(model, rest, stored, q.method)
    else:
        names += _quantize_experts(model, q)
    model.ignored_checkpoint_suffixes = IGNORED_SUFFIXES
    logger.info("quantization %s (%s): %d linear / expert modules quantized; kernels: %s", q.method, q.source,
                len(names), _KERNELS[q.method])
    return names
