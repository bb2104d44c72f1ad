"""Quantizing a loaded 16-bit model at load (``LLM(quantization="fp8"|"nvfp4")``, source "online")
frees each 16-bit module as soon as its quantized one replaces it, so the peak is the 16-bit model
plus one layer, not both models at once (the full Nano-30B-A3B shape, 63 GB in bf16, ran out of
memory on an 80 GB H100 while its quantized copy grew beside it)."""
import gc
import weakref

import pytest
import torch
from torch import nn

from hybrid_engine.models.moe import Experts
from hybrid_engine.quantization import experts as quant_experts
from hybrid_engine.quantization import linear as quant_linear
from hybrid_engine.quantization.config import QuantConfig


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(32, 48), "experts": Experts(4, 32, 16)})
                                    for _ in range(3))
        self.lm_head = nn.Linear(32, 64, bias=False)


@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_each_16bit_module_is_freed_before_the_next_is_quantized(method, monkeypatch):
    torch.manual_seed(0)
    model = Toy().to(torch.bfloat16)
    sources: list[weakref.ref] = []
    alive_at_each_call: list[int] = []     # 16-bit modules quantized earlier and still alive

    def watched(real):
        def quantize(src, *a, **k):
            alive_at_each_call.append(sum(r() is not None for r in sources))
            sources.append(weakref.ref(src))
            return real(src, *a, **k)
        return quantize
    key = (method, "online")
    monkeypatch.setitem(quant_linear.LINEAR_METHODS, key, watched(quant_linear.LINEAR_METHODS[key]))
    for cls in (quant_experts.Fp8Experts, quant_experts.Nvfp4Experts):
        monkeypatch.setattr(cls, "quantized_from", staticmethod(watched(cls.quantized_from)))
    # the cycle collector off: on CUDA a module kept for it would hold its memory while quantizing
    # goes on, so the 16-bit modules must be freed by their reference counts alone
    gc.collect()
    gc.disable()
    try:
        names = quant_linear.quantize_linears(model, QuantConfig(method=method, source="online"))
    finally:
        gc.enable()
    assert len(names) == 4 + 3 and len(sources) == 4 + 3      # 3 linears + lm_head, 3 expert sets
    assert alive_at_each_call == [0] * len(sources), alive_at_each_call
    assert all(r() is None for r in sources)
    assert all(isinstance(model.get_submodule(n), quant_linear.QuantLinear) or n.endswith("experts")
               for n in names)
