"""benchmarks/moe_chain.py's tile sweeps patch ``triton_moe.gemv_tiles`` with ``tiles_rule``: a
router candidate must reach the float32 router GEMV only, a shared-expert candidate the 16-bit
shared-expert GEMVs only, a routed-expert candidate its role (up or down) only, and every other
role keeps the real rule; ``--fp8`` layers are stored as ``quantization="fp8"`` stores them."""
import pytest
import torch

from benchmarks.moe_chain import tiles_rule


def real(role, tokens, weight):
    return ("real", role, tokens, weight.dtype)


def test_tiles_rule_replaces_only_the_named_rowwise_weights():
    f32, bf16 = torch.empty(2, 2), torch.empty(2, 2, dtype=torch.bfloat16)
    both = tiles_rule(real, router=(1, 2048, 4), shared=(8, 512, 4))
    assert both("rowwise", 1, f32) == (1, 2048, 4)
    assert both("rowwise", 4, bf16) == (8, 512, 4)
    assert both("up", 1, bf16) == ("real", "up", 1, torch.bfloat16)
    assert both("down", 8, bf16) == ("real", "down", 8, torch.bfloat16)
    router_only = tiles_rule(real, router=(4, 256, 8))
    assert router_only("rowwise", 1, bf16) == ("real", "rowwise", 1, torch.bfloat16)
    shared_only = tiles_rule(real, shared=(16, 128, 2))
    assert shared_only("rowwise", 1, f32) == ("real", "rowwise", 1, torch.float32)
    assert shared_only("rowwise", 1, bf16) == (16, 128, 2)


def test_tiles_rule_replaces_the_routed_experts_roles_it_is_given():
    from benchmarks.moe_chain import parse_expert_tiles
    fp8, bf16 = torch.empty(2, 2, dtype=torch.float8_e4m3fn), torch.empty(2, 2, dtype=torch.bfloat16)
    up_only = tiles_rule(real, **dict([parse_expert_tiles("up:16,512,4")]))
    assert up_only("up", 1, fp8) == (16, 512, 4)
    assert up_only("down", 1, fp8) == ("real", "down", 1, torch.float8_e4m3fn)
    assert up_only("rowwise", 1, bf16) == ("real", "rowwise", 1, torch.bfloat16)
    down_only = tiles_rule(real, down=(8, 512, 4))
    assert down_only("down", 4, bf16) == (8, 512, 4) and down_only("up", 4, bf16)[0] == "real"
    for bad in ("gate:16,512,4", "up:16,512", "up:a,b,c", "16,512,4"):
        with pytest.raises(ValueError, match="ROLE:BLOCK_N,BLOCK_K,WARPS"):
            parse_expert_tiles(bad)


def test_fp8_layer_stores_what_quantization_fp8_stores():
    """--fp8's layers: the routed experts as ``Fp8Experts.quantized_from`` quantizes them (one
    scale per expert and projection), the shared expert per channel as ``Fp8Linear`` does."""
    from benchmarks.moe_chain import fp8_layer
    from hybrid_engine.models.moe import Experts
    from hybrid_engine.quantization.experts import Fp8Experts
    from hybrid_engine.quantization.fp8 import quantize_fp8
    g = torch.Generator().manual_seed(0)
    E, F, D, FS = 4, 24, 16, 32
    ly = dict(gate=torch.randn(E, D, generator=g), bias=torch.zeros(E), up=torch.randn(E, F, D, generator=g),
              down=torch.randn(E, D, F, generator=g), s_up=torch.randn(FS, D, generator=g),
              s_down=torch.randn(D, FS, generator=g))
    q = fp8_layer(ly)
    experts = Experts(E, D, F)
    with torch.no_grad():
        experts.up_proj.copy_(ly["up"])
        experts.down_proj.copy_(ly["down"])
    ref = Fp8Experts.quantized_from(experts)
    for name in ("up", "down"):
        assert torch.equal(q[name].view(torch.uint8), getattr(ref, name + "_proj").view(torch.uint8))
        assert torch.equal(q[name + "_scale"], getattr(ref, name + "_proj_weight_scale"))
    w_q, s = quantize_fp8(ly["s_up"], per_channel=True)
    assert torch.equal(q["s_up"].view(torch.uint8), w_q.view(torch.uint8)) and torch.equal(q["s_up_scale"], s)
    assert q["gate"] is ly["gate"] and q["s_down"].dtype == torch.float8_e4m3fn
