"""The MoE block's shared expert as a ``moe_ops.SideOutput`` (``start_beside``) on the CPU paths:
routed_experts takes the handle as ``add`` wherever it takes a tensor, with the same result.
The CUDA side (the join before the combine) is tests/gpu/test_moe_kernels.py's."""
from types import SimpleNamespace

import pytest
import torch

from hybrid_engine.models.moe_ops import SideOutput, joined, routed_experts, start_beside


def test_start_beside_on_cpu_runs_now_and_waits_for_nothing():
    calls = []
    started = start_beside(lambda: calls.append(1) or torch.ones(3), torch.device("cpu"))
    assert calls == [1]                                  # ran before start_beside returned
    assert isinstance(started, SideOutput)
    assert torch.equal(started.wait(), torch.ones(3)) and started.wait() is started.wait()
    t = torch.zeros(2)
    assert joined(t) is t and joined(None) is None and joined(started) is started.wait()


@pytest.mark.parametrize("T", [0, 5])
@pytest.mark.parametrize("quant", [None, "nvfp4"])
def test_routed_experts_take_a_side_output_as_add(T, quant):
    from hybrid_engine.quantization.experts import Nvfp4Experts
    E, k, D, F = 8, 2, 32, 16
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, D, generator=g)
    up, down = torch.randn(E, F, D, generator=g), torch.randn(E, D, F, generator=g)
    scales = {}
    if quant == "nvfp4":
        q = Nvfp4Experts.quantized_from(SimpleNamespace(up_proj=up, down_proj=down))
        up, down = q.up_proj.data, q.down_proj.data
        scales = dict(up_scale=q.up_proj_weight_scale_2.data, down_scale=q.down_proj_weight_scale_2.data,
                      up_blocks=q.up_proj_weight_scale.data, down_blocks=q.down_proj_weight_scale.data)
    ids = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :k].to(torch.int32)
    wts = torch.rand(T, k, generator=g)
    add = torch.randn(T, D, generator=g)
    want = routed_experts(x, up, down, ids, wts, add=add, **scales)
    got = routed_experts(x, up, down, ids, wts, add=SideOutput(add.clone()), **scales)
    assert got.shape == (T, D)
    assert torch.equal(got, want)
    if T:
        assert not torch.equal(got, routed_experts(x, up, down, ids, wts, **scales))      # the add counted


@pytest.mark.parametrize("latent", [False, True])
def test_moe_block_joins_the_side_stream_when_its_experts_raise(monkeypatch, latent):
    """MoE.forward waits for the shared expert's SideOutput on every path, an exception's too:
    under a CUDA graph capture an unjoined fork makes the capture's end fail with an error that
    replaces the real one (an out-of-memory error the prefill graphs' capture loop must see)."""
    import hybrid_engine.models.moe as moe_mod
    from hybrid_engine.config import MOE, ModelConfig
    cfg = ModelConfig(layer_types=(MOE,), vocab_size=16, hidden_size=32, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=32, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                      routed_scaling_factor=2.5, moe_latent_size=16 if latent else None)
    moe = moe_mod.MoE(cfg)
    waits = []

    class Spy(SideOutput):
        def wait(self):
            waits.append(1)
            return super().wait()
    monkeypatch.setattr(moe_mod, "start_beside", lambda side, device: Spy(side()))
    x = torch.randn(3, 32)
    with torch.no_grad():
        moe(x)
        assert waits
        waits.clear()

        def oom(*a, **k):
            raise torch.OutOfMemoryError("routed experts")
        monkeypatch.setattr(moe_mod, "routed_experts", oom)
        with pytest.raises(torch.OutOfMemoryError):
            moe(x)
    assert waits
