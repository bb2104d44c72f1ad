"""The MoE benchmark's prefill FLOP count (benchmarks/moe_roofline.py ``prefill_flops``, the numerator of its
"% of matmul peak") against a count made by hand from the tiny shape's config: every projection's
2 * in * out per token, the router, the shared expert and the top-k routed experts of *every* MoE
layer (the count once took the experts of one layer only), causal attention, one lm_head row."""
import tempfile
from pathlib import Path

import pytest
import torch

from benchmarks.common import write_config
from benchmarks.moe import SHAPE_TINY, build_llm
from benchmarks.moe_roofline import param_split, prefill_flops


def test_prefill_flops_counts_the_experts_of_every_moe_layer():
    s = SHAPE_TINY
    md = write_config(Path(tempfile.mkdtemp()) / "m", s)
    llm = build_llm(md, torch.device("cpu"), torch.float32, 1, 256, 0.15)
    model, mc = llm.engine.model, llm.engine.cfg.model
    dense, per_expert = param_split(model)
    pattern = s["pattern"]
    n_mamba, n_moe, n_attn = pattern.count("M"), pattern.count("E"), pattern.count("*")
    assert (n_mamba, n_moe, n_attn) == (3, 3, 1)
    H, d_inner = s["hidden_size"], s["mamba_num_heads"] * s["mamba_head_dim"]
    in_proj = 2 * d_inner + 2 * s["n_groups"] * s["ssm_state_size"] + s["mamba_num_heads"]
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    mamba = H * in_proj + d_inner * H
    attn_proj = H * q + 2 * H * kv + q * H
    moe = (H * s["n_routed_experts"] + 2 * H * s["moe_shared_expert_intermediate_size"]
           + s["num_experts_per_tok"] * 2 * H * s["moe_intermediate_size"])
    n = 256
    by_hand = (n * 2 * (n_mamba * mamba + n_attn * attn_proj + n_moe * moe)
               + n_attn * 4 * q * n * (n / 2) + 2 * H * s["vocab_size"])
    got = prefill_flops(mc, n, dense, per_expert, n_moe)
    # the count takes every parameter (norms, conv taps, biases) at 2 FLOPs a token: ~2% above
    assert got == pytest.approx(by_hand, rel=0.03)
    # a bf16 model counts the same (parameters, not bytes: its router stays float32)
    llm16 = build_llm(md, torch.device("cpu"), torch.bfloat16, 1, 256, 0.15)
    assert param_split(llm16.engine.model) == (dense, per_expert)
    one_layer = prefill_flops(mc, n, dense, per_expert, 1)     # the old count
    assert one_layer < 0.85 * by_hand


def _tiny_bf16_and_quantized(quantization: str):
    """The tiny MoE shape's models on CPU: bf16, and the same random weights quantized at load."""
    md = write_config(Path(tempfile.mkdtemp()) / "m", SHAPE_TINY)
    models = [build_llm(md, torch.device("cpu"), torch.bfloat16, 1, 256, 0.15, **kw).engine.model
              for kw in ({}, dict(quantization=quantization))]
    return tuple(models)


def test_fp8_rows_count_the_experts_as_stored():
    """``moe.py --quantization fp8``: the random weights are quantized at load (routed experts and
    linears), and the roofline's byte count (``weight_split``) takes an FP8 expert at one byte a
    weight, half a bf16 one; the prefill FLOPs (``param_split``) do not change."""
    from benchmarks.moe_roofline import weight_split
    from hybrid_engine.quantization.experts import Fp8Experts
    bf16, fp8 = _tiny_bf16_and_quantized("fp8")
    assert sum(isinstance(m, Fp8Experts) for m in fp8.modules()) == SHAPE_TINY["pattern"].count("E")
    dense16, expert16, emb16 = weight_split(bf16)
    dense8, expert8, emb8 = weight_split(fp8)
    assert expert16 == 2 * expert8 and emb8 == emb16
    assert dense8 < 0.75 * dense16            # the linears are FP8 too (the router and norms are not)
    assert param_split(fp8) == param_split(bf16)


def test_nvfp4_rows_count_the_experts_as_stored():
    """``moe.py --quantization nvfp4``: routed experts stored NVFP4 read half a byte a weight plus
    a float8 block scale per 16 weights (0.5625 / 2 of a bf16 expert), and still multiply every
    weight in a prefill (the packed uint8 tensors hold two weights each)."""
    from benchmarks.moe_roofline import weight_split
    from hybrid_engine.quantization.experts import Nvfp4Experts
    bf16, nv = _tiny_bf16_and_quantized("nvfp4")
    assert sum(isinstance(m, Nvfp4Experts) for m in nv.modules()) == SHAPE_TINY["pattern"].count("E")
    _, expert16, emb16 = weight_split(bf16)
    _, expert4, emb4 = weight_split(nv)
    assert expert4 * 2 == expert16 * 0.5625 and emb4 == emb16
    assert param_split(nv) == param_split(bf16)


def test_expert_tiles_round_each_experts_rows_up_to_whole_tiles():
    """moe_roofline.expert_tiles: counts over several calls are scaled to one call's pairs; each
    expert's rows round up to whole tiles; empty layers are skipped."""
    from benchmarks.moe_roofline import expert_tiles
    # two layers, 4 experts, counted over 3 calls of 64 pairs: per call [30, 20, 14, 0] and [16] * 4
    load = {0: [90, 60, 42, 0], 1: [48, 48, 48, 48], 2: [0, 0, 0, 0]}
    got = expert_tiles(load, pairs=64, block_m=16)
    assert got == dict(tiles_per_layer=(2 + 2 + 1 + 0 + 4) / 2, largest_expert_rows=(30 + 16) / 2, block_m=16)
    assert expert_tiles({}, pairs=64, block_m=16) == {}
