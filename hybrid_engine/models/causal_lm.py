"""What the families' causal LMs share: the runtime-state hooks the engine calls, and the logits
(lm_head, then the family's logit multiplier / divisor). Nemotron-H, Bamba, Granite-4.0-H and
Falcon-H1 derive from it (families.py lists the forward contract)."""
from __future__ import annotations

import torch
from torch import nn


class HybridCausalLM(nn.Module):
    keep_in_fp32: tuple[str, ...] = ()             # loader: tensor-name suffixes kept float32
    embedding_name = "model.embed_tokens.weight"   # loader: the tensor a tied lm_head shares
    supports_mtp = False                           # the checkpoint family has MTP layers we run
    logits_mul = 1.0                               # logits = lm_head(h) * logits_mul / logits_div
    logits_div = 1.0

    embedding_multiplier = 1.0                     # hidden = embed(ids) * embedding_multiplier

    def _attach(self, cfg, model: nn.Module) -> None:
        """The common head: ``cfg``, the backbone ``model`` (with ``embed_tokens``) and an lm_head,
        tied to the embedding when the config says so."""
        from .linear import Linear
        self.cfg = cfg
        self.model = model
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight

    def _run_layers(self, fb, caches, final_norm: nn.Module):
        """Final-normed hidden states [T, D]: embedding (times ``embedding_multiplier``), every
        layer as ``layer(h, residual, fb, caches) -> (h, residual)``, then the final norm that adds
        the last residual."""
        h = self.model.embed_tokens(fb.input_ids)
        if self.embedding_multiplier != 1.0:
            h = h * self.embedding_multiplier
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, fb, caches)
        return final_norm.add_norm(h, residual)[0]

    def follow(self, fb, caches) -> None:
        """Every scheduled token's cache writes (Mamba states, KV), no output: a draft model
        following a step after which it drafts nothing (adaptive speculation at rest). Here the
        whole forward; a family may stop after its last cache-owning layer (Nemotron-H does)."""
        self(fb, caches)

    def reset_runtime_state(self) -> None:
        """Rebuild the buffers the checkpoint does not fill (MoE expert-load counters, RoPE
        frequencies): the model is materialised from the meta device with them unset."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_runtime_state"):
                m.reset_runtime_state()

    def read_expert_load(self) -> dict[str, list[int]]:
        """{MoE module name: tokens routed to each expert since the last read}; clears the
        counters. Reads the device (a sync): for stats(), never on the step path."""
        return {name: m.read_expert_load() for name, m in self.named_modules() if hasattr(m, "read_expert_load")
                and m is not self}

    def compute_logits(self, hidden: torch.Tensor, head: nn.Module | None = None) -> torch.Tensor:
        """[L, D] -> [L, V] float32 logits; ``head``: another module in the lm_head's place (the MTP
        drafter's view of its first rows, ``spec/drafters/draft_vocab.py``) -> [L, its rows]."""
        logits = (self.lm_head if head is None else head)(hidden).float()
        if self.logits_mul != 1.0:
            logits = logits * self.logits_mul
        if self.logits_div != 1.0:
            logits = logits / self.logits_div
        return logits


def layers_by_kind(cfg, make_layer) -> nn.ModuleList:
    """One layer per ``cfg.layer_types`` entry, ``make_layer(cfg, kind, ordinal)`` where ordinal
    counts the layers of that kind before it (the index of its Mamba state or KV cache)."""
    ordinals: dict[str, int] = {}
    layers = []
    for kind in cfg.layer_types:
        layers.append(make_layer(cfg, kind, ordinals.get(kind, 0)))
        ordinals[kind] = ordinals.get(kind, 0) + 1
    return nn.ModuleList(layers)
