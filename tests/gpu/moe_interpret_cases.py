"""MoE kernels on CPU under TRITON_INTERPRET=1 (set by the caller before this process starts).
Tiny float32 cases (bf16 tl.dot is wrong in the interpreter) and one float16 GEMV case.
Prints ``CASE <name> OK|FAIL ...`` per case (see tests/triton_interpret.py)."""
import os
import sys

import torch
from triton_interpret import case_main

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"
torch.set_num_threads(1)

import moe_cases as mc  # noqa: E402
from hybrid_engine.models.moe_align import align_pairs_chunked, align_pairs_triton  # noqa: E402
from hybrid_engine.models.triton_moe import routed_experts_triton, rowwise_linear_triton  # noqa: E402
from hybrid_engine.models.triton_moe_route import route_triton  # noqa: E402

F32, F16 = torch.float32, torch.float16


def grouped(*a, **kw):
    return routed_experts_triton(*a, force_grouped=True, **kw)


def moe_block(latent: bool):
    """The MoE block's forward through the Triton kernels (backend forced) vs its CPU path."""
    from hybrid_engine.config import MOE, ModelConfig
    from hybrid_engine.models import moe_ops
    from hybrid_engine.models.moe import MoE
    from hybrid_engine.models.synthetic import sens_init_
    cfg = ModelConfig(layer_types=(MOE,), vocab_size=16, hidden_size=16, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=16, n_routed_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                      routed_scaling_factor=2.5, moe_latent_size=8 if latent else None)
    moe = MoE(cfg)
    sens_init_(moe, seed=3)
    moe.reset_runtime_state()
    errs = []
    for T in (3, 11):                                # decode path and grouped path
        x = torch.randn(T, 16, generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            ref = moe(x)
            ref_counts = moe.read_expert_load()
            real = moe_ops.kernel_backend
            moe_ops.kernel_backend = lambda op, device: "triton"
            try:
                got = moe(x)
            finally:
                moe_ops.kernel_backend = real
        assert moe.read_expert_load() == ref_counts and sum(ref_counts) == 3 * T
        err = (got - ref).abs().max().item()
        assert ref.abs().max() > 1.0 and err < 1e-4, err
        errs.append(err)
    return max(errs)


def granite_moe_block():
    """Granite-4.0-H's MoE (softmax router, SwiGLU experts, shared MLP added) through the Triton
    kernels (backend forced) vs its CPU path."""
    from hybrid_engine.config import ATTENTION, ModelConfig
    from hybrid_engine.models import moe_ops
    from hybrid_engine.models.granitemoehybrid import GraniteMoE, GraniteSettings
    from hybrid_engine.models.synthetic import sens_init_
    from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch
    cfg = ModelConfig(layer_types=(ATTENTION,), vocab_size=16, hidden_size=16, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, intermediate_size=12, n_routed_experts=8,
                      num_experts_per_tok=3, moe_intermediate_size=12, moe_router="softmax",
                      moe_activation="swiglu", family=GraniteSettings())
    moe = GraniteMoE(cfg)
    sens_init_(moe, seed=4)
    moe.reset_runtime_state()
    errs = []
    for T in (3, 11):                                # decode path and grouped path
        x = torch.randn(T, 16, generator=torch.Generator().manual_seed(T))
        add = torch.randn(T, 16, generator=torch.Generator().manual_seed(T + 50))
        slots = torch.arange(1, T + 1)
        fb = ForwardBatch(None, None, AttnMetadata(None, None, None, slots, 0, 0), None, None)
        with torch.no_grad():
            ref = moe(x, fb, add)
            ref_counts = moe.read_expert_load()
            real = moe_ops.kernel_backend
            moe_ops.kernel_backend = lambda op, device: "triton"
            try:
                got = moe(x, fb, add)
            finally:
                moe_ops.kernel_backend = real
        assert moe.read_expert_load() == ref_counts and sum(ref_counts) == 3 * T
        err = (got - ref).abs().max().item()
        assert ref.abs().max() > 1.0 and err < 1e-4, err
        errs.append(err)
    return max(errs)


CASES = {
    "moe_align": lambda: mc.check_align("cpu", 13, 8, 3, 4, "ragged", align_fn=align_pairs_triton),
    "moe_align_one": lambda: mc.check_align("cpu", 9, 16, 2, 8, "one", seed=1, align_fn=align_pairs_triton),
    # the prefill form: several chunks (CH 128 pairs at 128 experts, 32 at 512), ragged and one-hot loads
    "moe_align_chunked": lambda: mc.check_align("cpu", 300, 128, 6, 16, "ragged", align_fn=align_pairs_chunked),
    "moe_align_chunked_one": lambda: mc.check_align("cpu", 200, 128, 6, 128, "one", seed=2,
                                                    align_fn=align_pairs_chunked),
    "moe_align_chunked_512": lambda: mc.check_align("cpu", 70, 512, 22, 16, "ragged", seed=3,
                                                    align_fn=align_pairs_chunked),
    "moe_router_logits_f16": lambda: mc.check_rowwise(rowwise_linear_triton, "cpu", F16, 3, 24, 40,
                                                       w_dtype=F32, out_dtype=F32),
    # prefill-sized bf16 rows (T, E, D ragged against 16 x 16 x 32 tiles: three K steps, the last partial)
    "moe_router_logits_bf16": lambda: mc.check_router_logits("cpu", 37, 20, 80, tiles=(16, 16, 32, 4)),
    "moe_shared_up_relu2": lambda: mc.check_rowwise(rowwise_linear_triton, "cpu", F32, 2, 40, 24, relu2=True,
                                                    seed=1),
    "moe_block": lambda: moe_block(False),
    "moe_block_latent": lambda: moe_block(True),
    "moe_route": lambda: mc.check_route(route_triton, "cpu", 6, 16, 3),
    "moe_route_groups": lambda: mc.check_route(route_triton, "cpu", 5, 16, 3, n_group=4, topk_group=2,
                                               seed=1),
    "moe_route_no_renorm": lambda: mc.check_route(route_triton, "cpu", 3, 12, 2, renorm=False, scale=1.0,
                                                  seed=2),
    "moe_route_softmax": lambda: mc.check_route(route_triton, "cpu", 6, 16, 3, scale=1.0, scoring="softmax",
                                                seed=3),
    "moe_decode_swiglu": lambda: mc.check_experts(routed_experts_triton, "cpu", F32, 3, 8, 2, 24, 20,
                                                  activation="swiglu", seed=5),
    "moe_decode_swiglu_add_f16": lambda: mc.check_experts(routed_experts_triton, "cpu", F16, 2, 8, 3, 16, 24,
                                                          add=True, activation="swiglu", seed=6),
    "moe_grouped_swiglu_ragged": lambda: mc.check_experts(grouped, "cpu", F32, 11, 8, 2, 24, 20, load="ragged",
                                                          activation="swiglu", seed=7),
    "moe_block_granite": granite_moe_block,
    "moe_decode": lambda: mc.check_experts(routed_experts_triton, "cpu", F32, 3, 8, 2, 24, 20),
    "moe_decode_add_f16": lambda: mc.check_experts(routed_experts_triton, "cpu", F16, 2, 8, 3, 16, 24,
                                                   add=True, seed=1),
    "moe_grouped_ragged": lambda: mc.check_experts(grouped, "cpu", F32, 11, 8, 2, 24, 20, load="ragged",
                                                   seed=2),
    "moe_grouped_one_expert_add": lambda: mc.check_experts(grouped, "cpu", F32, 9, 6, 2, 16, 24, load="one",
                                                           add=True, seed=3),
    "moe_grouped_latent_shape": lambda: mc.check_experts(grouped, "cpu", F32, 7, 8, 3, 12, 20, load="few",
                                                         seed=4),
}


def main(names):
    return case_main(CASES, names)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
