"""Nemotron-H multi-token-prediction (MTP) layers, as published checkpoints lay them out.

One MTP step is a run of sub-layers ``mtp.layers.{i}`` (one per symbol of the MTP pattern, "*E" by
default). The first has ``enorm``, ``hnorm`` and ``eh_proj`` ([D, 2D]):
``h = eh_proj(cat(enorm(embed(token)), hnorm(prev_hidden)))``; each is a pre-norm residual block
(``norm`` + ``mixer``); the last has ``final_layernorm`` before the shared lm_head.
Pair index i combines the target's hidden h_i with token t_{i+1} and predicts t_{i+2}; its KV is
stored at position i, so the MTP attention replays the target's own positions and block tables.

``rows``: the drafter needs the outputs of one token per sequence (its newest sample's pair), but
the KV of every pair. The layers after the last attention layer (and the final norm) then run on
those rows only: in the published ``*E`` pattern the MoE layer sees one token per sequence instead
of 1 + K per decode row (after a step with prefill rows the drafter does not run this pass: it
writes the KV with ``follow`` and takes the newest pair as a one-token ``forward``). The drafts are those of the
full pass up to float rounding (the kept rows go through the MoE and linear kernels in smaller
batches); the MoE's expert-load counters then count one token per sequence and pass (none on
a resting step: ``follow`` does not reach the MoE).

``follow``: the KV alone, for a step after which nothing is drafted (adaptive speculation at
rest): the layers up to the last attention layer, that layer's k and v only. In ``*E`` that is the
two input norms, the input projection, the attention layer's norm and the k / v projections; the
attention itself, o_proj, the MoE, the final norm and the lm_head are not run (their outputs
would be read by nothing).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ..config import ATTENTION, MLP as MLP_KIND, MOE, ModelConfig
from ..step.forward_batch import ForwardBatch
from .layers import MLP, RMSNorm
from .linear import Linear
from .moe import MoE
from .rmsnorm import rmsnorm_into


class MTPLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, attn_ordinal: int, first: bool, last: bool):
        super().__init__()
        from .nemotron_h import Attention
        d, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        if first:
            self.enorm, self.hnorm = RMSNorm(d, eps), RMSNorm(d, eps)
            self.eh_proj = Linear(2 * d, d, bias=False)
        self.norm = RMSNorm(d, eps)
        if kind == ATTENTION:
            self.mixer = Attention(cfg, attn_ordinal)
        elif kind == MOE:
            self.mixer = MoE(cfg)
        elif kind == MLP_KIND:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        else:
            raise ValueError(f"MTP layer kind {kind!r} is not supported; allowed: *, -, E")
        if last:
            self.final_layernorm = RMSNorm(d, eps)
        self.first, self.last, self.attn = first, last, kind == ATTENTION
        self.takes_batch = self.attn or getattr(self.mixer, "takes_batch", False)


class MTP(nn.Module):
    """The first MTP step of the checkpoint (later steps, if any, are not used)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        kinds = cfg.mtp_layer_types
        n_attn = 0
        layers = []
        for j, kind in enumerate(kinds):
            layers.append(MTPLayer(cfg, kind, n_attn, j == 0, j == len(kinds) - 1))
            n_attn += kind == ATTENTION
        self.layers = nn.ModuleList(layers)
        self.num_attention_layers = n_attn
        # the first layer whose outputs are needed at the kept rows only: after the last attention
        # layer (whose KV every pair needs), 0 without attention
        self.rows_from = 1 + max((j for j, kind in enumerate(kinds) if kind == ATTENTION), default=-1)

    def forward(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, fb: ForwardBatch, caches,
                rows: torch.Tensor | None = None):
        """embeds, prev_hidden [T, D] -> (hidden before final norm, normed), each [T, D], or
        [R, D] at ``rows`` [R] (token indices into T; module docstring)."""
        if rows is not None and self.rows_from == 0:
            embeds, prev_hidden, fb = embeds[rows], prev_hidden[rows], _at_rows(fb, rows)
            rows = None
        first = self.layers[0]
        h = first.eh_proj(self._eh_input(first, embeds, prev_hidden))
        residual = None
        for j, layer in enumerate(self.layers):   # residual adds fused into the next norm (as Block)
            if rows is not None and j == self.rows_from:
                h, residual, fb = h[rows], residual[rows], _at_rows(fb, rows)
            x, residual = layer.norm.add_norm(h, residual)
            h = layer.mixer(x, fb, caches) if layer.takes_batch else layer.mixer(x)
        if rows is not None and self.rows_from == len(self.layers):
            h, residual = h[rows], residual[rows]
        normed, h = self.layers[-1].final_layernorm.add_norm(h, residual)
        return h, normed

    def follow(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, fb: ForwardBatch, caches) -> None:
        """The MTP KV of every pair and nothing else (the drafter following a step it drafts
        nothing after): the layers up to the last attention layer, which only writes its KV
        (``Attention.write_kv_only``); no layer after it, no final norm. The KV is ``forward``'s,
        bit for bit (the same ops on the same inputs up to the writes)."""
        last = self.rows_from - 1                 # the last attention layer; -1: the block has none
        if last < 0:
            return
        first = self.layers[0]
        h = first.eh_proj(self._eh_input(first, embeds, prev_hidden))
        residual = None
        for layer in self.layers[:last]:
            x, residual = layer.norm.add_norm(h, residual)
            h = layer.mixer(x, fb, caches) if layer.takes_batch else layer.mixer(x)
        x, _ = self.layers[last].norm.add_norm(h, residual)
        self.layers[last].mixer.write_kv_only(x, fb, caches)

    @staticmethod
    def _eh_input(first: MTPLayer, embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """cat(enorm(embeds), hnorm(prev_hidden)) [T, 2D]: the two norms write the halves of one
        buffer (no cat launch: three per MTP K = 3 step) where both are plain RMSNorms of one dtype."""
        if (type(first.enorm) is RMSNorm and type(first.hnorm) is RMSNorm and embeds.dtype == prev_hidden.dtype
                and embeds.shape == prev_hidden.shape and embeds.dim() == 2):
            T, D = embeds.shape
            out = embeds.new_empty(T, 2 * D)
            rmsnorm_into(embeds, first.enorm.weight, first.enorm.eps, out[:, :D])
            rmsnorm_into(prev_hidden, first.hnorm.weight, first.hnorm.eps, out[:, D:])
            return out
        return torch.cat([first.enorm(embeds), first.hnorm(prev_hidden)], -1)


def _at_rows(fb: ForwardBatch, rows: torch.Tensor) -> ForwardBatch:
    """The batch as the layers after the row cut see it: each kept token's slot mapping (the MoE
    counts only real tokens, slot != 0, in its expert load). No attention layer reads it."""
    return replace(fb, attn=replace(fb.attn, slot_mapping=fb.attn.slot_mapping[rows]))
