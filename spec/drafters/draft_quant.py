"""FP8 drafter weights (``SpeculativeConfig.quantization="fp8"``).

A draft token only has to be likely: verification reads the target's own weights, so greedy
outputs are identical whatever the drafter computes, and sampled outputs keep their distribution
(rejection sampling is exact for any draft distribution). On a bandwidth-bound step the drafter's
cost is the bytes it reads, and FP8 weights are half of bfloat16's. An 8B-shape MTP proposal reads
the target's 131072-row lm_head once per draft token (1 GB in bfloat16, ~70% of an MTP pass).

FP8 pays where the FP8 decode kernels run: up to ``fp8.MAX_SKINNY_ROWS`` rows a projection. Wider
steps take the W8A8 path, which read no faster on the 8B MTP block at batch 32 (H200, 2026-11-28:
the MTP speed-up fell from 1.22x to 1.12x with every drafter layer in FP8). So each drafter linear
layer keeps its unquantized weights (16-bit, or float32 in a float32 engine) and gains an FP8 copy
(``FewRowsFp8``): a call with at most that many rows reads the copy, a wider one the unquantized
weights. The row count is the input's shape, known on
the host, so the choice costs no sync and a CUDA graph captures one side.

- method "mtp": the MTP block's linear layers, and the lm_head rows the drafts score (an FP8 copy
  beside the target's lm_head, which verification keeps reading);
- method "draft_model": every linear layer of the draft model, its lm_head included.

Routed experts get an FP8 copy too (``FewRowsFp8Experts``: the fused MoE's FP8 layout, one scale
an expert and projection), picked by the same row rule through ``Experts.weights_for``; a shared
expert's layers get ``FewRowsFp8`` copies like any other (few-row calls then leave the fused
16-bit shared-expert path for the copies' FP8 kernels). On the 8B shape's MTP block (``*E``: 8
experts of 7688, top-2, a shared expert of 7688) the experts hold ~64% of the bytes a pass reads
once its other layers are FP8 (counted from the shapes). Linear layers get per-output-channel
scales, the quantizer of ``LLM(quantization="fp8")``.
Device memory: the copies (``copy_bytes``, ``experts_copy_bytes``: codes, scales, biases), about half
the copied 16-bit weights, budgeted before the KV cache is sized.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from hybrid_engine.quantization.fp8 import MAX_SKINNY_ROWS
from hybrid_engine.models.layers import project_relu2
from hybrid_engine.models.moe import Experts
from hybrid_engine.quantization.experts import Fp8Experts
from hybrid_engine.quantization.linear import Fp8Linear, QuantLinear

logger = logging.getLogger("hybrid_engine")

# drafter calls of at most this many rows read the FP8 copy (the FP8 decode kernels' range). The
# routed experts take the same rule: beyond it the fused MoE's grouped GEMM reads FP8 experts no
# faster than 16-bit ones (8B MTP MoE at 32 tokens, H200, 2026-11-28: 339 vs 333 us)
FP8_MAX_ROWS = MAX_SKINNY_ROWS


class FewRowsFp8(nn.Module):
    """A 16-bit linear layer (``wide``) and its FP8 copy (``narrow``): x [..., K] with at most
    ``max_rows`` rows goes through the copy, wider x through ``wide``. ``weight`` / ``bias`` are the
    16-bit ones, for readers of the values (a fused shared-expert path, dtype checks)."""

    def __init__(self, wide: nn.Linear, max_rows: int = FP8_MAX_ROWS):
        super().__init__()
        # per-channel quantization goes in chunks of rows (fp8.quantize_fp8): no 2 GB of float32
        # temporaries for an 8B lm_head beside an already sized KV cache
        self.wide, self.narrow = wide, Fp8Linear.quantized_from(wide, per_channel=True)
        self.max_rows = max_rows
        self.in_features, self.out_features = wide.in_features, wide.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.wide.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.wide.bias

    def _pick(self, x: torch.Tensor) -> nn.Module:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return self.narrow if rows <= self.max_rows else self.wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pick(x)(x)

    def forward_relu2(self, x: torch.Tensor) -> torch.Tensor:
        """``self(relu2(x))`` (``layers.project_relu2``) through the side ``forward`` would take
        (``project_relu2`` again, so forward hooks on that side still see its input)."""
        return project_relu2(self._pick(x), x)

    def extra_repr(self) -> str:
        return f"max_rows={self.max_rows}"


class FewRowsFp8Experts(nn.Module):
    """Routed experts (``models.moe.Experts``, ``wide``) and their FP8 copy (``Fp8Experts``,
    ``narrow``: a float32 scale an expert and projection, as the fused MoE reads FP8 experts): a
    forward of at most ``max_rows`` token rows reads the copy (``weights_for``)."""

    def __init__(self, wide: Experts, max_rows: int = FP8_MAX_ROWS):
        super().__init__()
        self.wide, self.narrow = wide, Fp8Experts.quantized_from(wide)      # one expert at a time
        self.max_rows = max_rows

    def weights_for(self, rows: int):
        return (self.narrow if rows <= self.max_rows else self.wide).weights_for(rows)

    def extra_repr(self) -> str:
        return f"max_rows={self.max_rows}"


def copied_linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers of ``block`` that get an FP8 copy: 16-bit ones (not quantized already, not
    copied already)."""
    done = {n for n, m in block.named_modules() if isinstance(m, FewRowsFp8)}
    return [(n, m) for n, m in block.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, QuantLinear) and n.rpartition(".")[0] not in done]


def copied_experts(block: nn.Module) -> list[tuple[str, Experts]]:
    """The 16-bit routed experts of ``block`` (``type`` exactly ``Experts``: not FP8 already), not
    copied already."""
    done = {n for n, m in block.named_modules() if isinstance(m, FewRowsFp8Experts)}
    return [(n, m) for n, m in block.named_modules() if type(m) is Experts and n.rpartition(".")[0] not in done]


def copy_bytes(out_features: int, in_features: int, bias_bytes: int = 0) -> int:
    """Device bytes of one FP8 copy: the codes, a float32 scale a row, and the bias."""
    return out_features * in_features + 4 * out_features + bias_bytes


def experts_copy_bytes(experts: Experts) -> int:
    """Device bytes of ``FewRowsFp8Experts``' copy: the codes of both projections, two float32
    scales an expert."""
    return experts.up_proj.numel() + experts.down_proj.numel() + 2 * 4 * experts.up_proj.shape[0]


def copies_bytes(block: nn.Module, dtype: torch.dtype) -> int:
    """Device bytes of the copies ``add_fp8_copies`` makes for ``block`` (it may live on the meta
    device); biases in ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (sum(copy_bytes(m.out_features, m.in_features, 0 if m.bias is None else m.bias.numel() * itemsize)
                for _, m in copied_linears(block))
            + sum(experts_copy_bytes(m) for _, m in copied_experts(block)))


def _swap(block: nn.Module, name: str, make) -> None:
    parent, _, attr = name.rpartition(".")
    owner = block.get_submodule(parent) if parent else block
    setattr(owner, attr, make(getattr(owner, attr)))


def add_fp8_copies(block: nn.Module, what: str) -> int:
    """Give ``block``'s ``copied_linears`` (``FewRowsFp8``) and ``copied_experts``
    (``FewRowsFp8Experts``) an FP8 copy each, swapped in place -> how many."""
    linears, experts = [n for n, _ in copied_linears(block)], [n for n, _ in copied_experts(block)]
    for n in linears:
        _swap(block, n, FewRowsFp8)
    for n in experts:
        _swap(block, n, FewRowsFp8Experts)
    logger.info("%s: FP8 copies of %d linear layers and %d routed-expert sets, read by calls of at most %d rows",
                what, len(linears), len(experts), FP8_MAX_ROWS)
    return len(linears) + len(experts)


def draft_head(head: nn.Module) -> nn.Module:
    """``head`` (the lm_head, or the view of its first rows a reduced draft vocabulary scores) with
    an FP8 copy for few rows; a head that is already quantized is returned as it is."""
    if isinstance(head, QuantLinear):
        logger.info("MTP drafter: the lm_head is already %s; drafts use it as it is", type(head).__name__)
        return head
    if not isinstance(head, nn.Linear):
        raise TypeError(f"speculative_config.quantization: the lm_head ({type(head).__name__}) is not a linear "
                        "layer that can be quantized")
    return FewRowsFp8(head)


