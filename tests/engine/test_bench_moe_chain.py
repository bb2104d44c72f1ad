"""benchmarks/moe_chain.py's tile sweeps patch ``triton_moe.gemv_tiles`` with ``tiles_rule``: a
router candidate must reach the float32 router GEMV only, a shared-expert candidate the 16-bit
shared-expert GEMVs only, and every other role (the routed experts) keeps the real rule."""
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
