"""Nemotron-H MoE block: sigmoid top-k router, routed relu² experts stored merged, a shared expert,
optional latent projections (``moe_latent_size``), and per-expert load counters.

Layout (checkpoint names, so the loader maps them; per-expert checkpoints are stacked into the
merged tensors at load, one expert at a time):
  gate.weight [E, D] (kept float32: the router runs in float32), gate.e_score_correction_bias [E]
  experts.up_proj [E, F, D_in], experts.down_proj [E, D_in, F]     (D_in = moe_latent_size or D)
  shared_experts.up_proj / down_proj (a relu² MLP of moe_shared_expert_intermediate_size on D)
  fc1_latent_proj [L, D], fc2_latent_proj [D, L]                   (latent MoE only)
Forward (transformers' NemotronHMoE): routed = experts(fc1(x)) with weights from gate(x), then
fc2(routed) + shared(x). The work goes through ``moe_ops`` (Triton on CUDA, gather by expert on CPU);
on CUDA the shared expert runs on a side stream beside the router, the routing and the routed
experts, joined at their combine (``moe_ops.start_beside``).

Expert load: each forward adds the number of real tokens (``fb.attn.slot_mapping != 0``: padding
rows of CUDA-graph buckets write the null KV block) routed to each expert to ``expert_tokens``
[E] int32 on the device; ``read_expert_load`` reads and clears it (called by stats(), never on the
step path). The MTP block's MoE sees one token per sequence and pass (``models/mtp.py``), so its
counters count those.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .layers import MLP
from .linear import Linear
from .moe_ops import ExpertWeights, RouteSpec, route, routed_experts, router_logits, shared_expert, start_beside

ROUTER_FP32_WEIGHTS = ("gate.weight",)     # loader keep_in_fp32 suffixes owned by this module


class TopkRouter(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.spec = RouteSpec(num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok,
                              n_group=cfg.n_group, topk_group=cfg.topk_group,
                              norm_topk_prob=cfg.norm_topk_prob, scale=float(cfg.routed_scaling_factor))
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[T, D] -> [T, E] float32 (the weight is float32 after loading; .float() is then free)."""
        return router_logits(x, self.weight)

    def forward(self, x: torch.Tensor, counts: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return route(self.logits(x), self.e_score_correction_bias, self.spec, counts, valid)


class Experts(nn.Module):
    """Routed experts merged: up_proj [E, F, D_in], down_proj [E, D_in, F] (no bias)."""

    def __init__(self, num_experts: int, inner: int, width: int):
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num_experts, width, inner))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inner, width))

    def weights_for(self, rows: int) -> ExpertWeights:
        """The tensors a forward of ``rows`` token rows reads. Quantized experts
        (``quantization.experts.Fp8Experts``) give their scales too; a drafter's experts with an
        FP8 copy (``spec/drafters/draft_quant.FewRowsFp8Experts``) pick a side by ``rows``."""
        return ExpertWeights(up=self.up_proj, down=self.down_proj)


class MoE(nn.Module):
    takes_batch = True          # forward(x, fb, caches): fb marks padding tokens for the counters

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inner = cfg.moe_latent_size or cfg.hidden_size
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg.n_routed_experts, inner, cfg.moe_intermediate_size)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias)
        if cfg.moe_latent_size:
            self.fc1_latent_proj = Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        # not in the state dict; zeroed by reset_runtime_state() after the model is materialised
        self.register_buffer("expert_tokens", torch.zeros(cfg.n_routed_experts, dtype=torch.int32),
                             persistent=False)

    def reset_runtime_state(self) -> None:
        self.expert_tokens.zero_()

    def read_expert_load(self) -> list[int]:
        """Tokens routed to each expert since the last read (host sync: stats only)."""
        counts = self.expert_tokens.tolist()
        self.expert_tokens.zero_()
        return counts

    def forward(self, x: torch.Tensor, fb=None, caches=None) -> torch.Tensor:
        valid = None if fb is None else fb.attn.slot_mapping[:x.shape[0]]
        # the shared expert [T, D] on a side stream (CUDA) while the router picks ids, w [T, k] and
        # the routed experts run; their combine joins it (a handle: ``moe_ops.SideOutput``)
        shared = start_beside(lambda: shared_expert(x, self.shared_experts), x.device)
        try:
            ids, w = self.gate(x, self.expert_tokens, valid)
            ew = self.experts.weights_for(x.shape[0])
            scales = dict(up_scale=ew.up_scale, down_scale=ew.down_scale, up_blocks=ew.up_blocks,
                          down_blocks=ew.down_blocks)
            if self.fc1_latent_proj is None:
                return routed_experts(x, ew.up, ew.down, ids, w, add=shared, **scales)
            routed = routed_experts(self.fc1_latent_proj(x), ew.up, ew.down, ids, w, **scales)
            return self.fc2_latent_proj(routed) + shared.wait()
        finally:
            # joined on every path, an exception's too (a no-op after the combine's): a graph
            # capture with an unjoined fork fails at its end with an error that would replace
            # this one (an out-of-memory error the prefill graphs' capture loop must see)
            shared.wait()
