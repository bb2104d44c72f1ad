"""Byte and FLOP accounting of the MoE benchmark (``benchmarks/moe.py``): which weights a decode
step reads (``weight_split``, ``distinct_experts``, ``step_state_bytes``) and which a prefill token
multiplies by (``param_split``, ``prefill_flops``), the denominators of its "% roofline" and
"% matmul peak" columns."""
from __future__ import annotations

import numpy as np
import torch


def distinct_experts(p: np.ndarray, b: int) -> float:
    """Expected distinct experts hit by b tokens when expert e is chosen by a token with
    probability p[e] (p sums to k), tokens independent."""
    return float(np.sum(1.0 - (1.0 - np.clip(p, 0.0, 1.0)) ** b))


def expert_tiles(load: dict, pairs: int, block_m: int) -> dict:
    """A prefill's grouped-GEMM tiles from its routing: ``load`` {layer: tokens per expert} over
    one or more calls of the same prompt (``stats()["moe_expert_tokens"]``), scaled to one call of
    ``pairs`` (tokens x top-k) pairs -> the mean over layers of the tiles of ``block_m`` rows (each
    expert's rows rounded up to whole tiles) and of the largest expert's rows. Even routing would
    give ceil(pairs / E / block_m) tiles an expert."""
    tiles, largest = [], []
    for counts in load.values():
        c = np.asarray(counts, dtype=np.float64)
        if c.sum() <= 0:
            continue
        c = np.rint(c * (pairs / c.sum()))
        tiles.append(float(np.ceil(c / block_m).sum()))
        largest.append(float(c.max()))
    if not tiles:
        return {}
    return dict(tiles_per_layer=sum(tiles) / len(tiles), largest_expert_rows=sum(largest) / len(largest),
                block_m=block_m)


def weight_split(model) -> tuple[int, int, int]:
    """(bytes of every weight but routed experts and embeddings, bytes of one routed expert,
    bytes of the embedding table). A routed expert's bytes are as stored: NVFP4's packed codes
    and their block scales ([E, N, K/16]) are read with it; FP8's [E] scales count as dense."""
    dense = expert = emb = 0
    for name, p in model.named_parameters():
        nb = p.numel() * p.element_size()
        if name.endswith(("experts.up_proj", "experts.down_proj")) or (
                name.endswith(("experts.up_proj_weight_scale", "experts.down_proj_weight_scale")) and p.dim() == 3):
            expert += nb // p.shape[0]
        elif name.endswith("embeddings.weight"):
            emb = nb
        else:
            dense += nb
    n_moe = sum(1 for n, _ in model.named_parameters() if n.endswith("experts.up_proj"))
    return dense, expert // max(n_moe, 1), emb


def param_split(model) -> tuple[int, int]:
    """(parameters of every weight a prefill token multiplies by, except the routed experts, the
    embedding table and the lm_head; parameters of one routed expert of one layer). Counted in
    elements, not bytes: the router stays float32 in a bf16 model; NVFP4's packed uint8 weights
    hold two each. A quantized model's scales (``*_scale``, ``*_scale_2``) are not weights a
    token multiplies by."""
    dense = expert = n_moe = 0
    for name, p in model.named_parameters():
        params = p.numel() * (2 if p.dtype == torch.uint8 else 1)
        if name.endswith(("experts.up_proj", "experts.down_proj")):
            expert += params // p.shape[0]
            n_moe += name.endswith("experts.up_proj")
        elif not name.endswith(("embeddings.weight", "lm_head.weight", "_scale", "_scale_2")):
            dense += params
    return dense, expert // max(n_moe, 1)


def prefill_flops(mc, n: int, dense_params: int, expert_params: int, moe_layers: int) -> float:
    """FLOPs of one prefill of ``n`` tokens: 2 per parameter per token for ``dense_params``
    (``param_split``: everything but the embeddings, the lm_head and the routed experts) and the
    ``num_experts_per_tok`` selected routed experts of every MoE layer (``expert_params``: one
    expert of one layer), causal attention (QK^T and PV over n/2 keys on average), and the lm_head
    for the last token only (tied or not). Before 2026-11-27 the experts were counted for one MoE
    layer instead of all of them."""
    per_token = 2 * (dense_params + moe_layers * mc.num_experts_per_tok * expert_params)
    attn = len(mc.attention_layer_ids) * 4 * mc.num_attention_heads * mc.head_dim * (n / 2)
    return n * (per_token + attn) + 2 * mc.vocab_size * mc.hidden_size


def step_state_bytes(mc, ctx: int) -> int:
    ssm = mc.mamba_num_heads * mc.mamba_head_dim * mc.ssm_state_size * 4 * 2       # read + write, f32
    conv = mc.conv_dim * (mc.conv_kernel - 1) * 2 * 2
    kv = ctx * mc.num_key_value_heads * mc.head_dim * 2 * 2
    return len(mc.mamba_layer_ids) * (ssm + conv) + len(mc.attention_layer_ids) * kv
