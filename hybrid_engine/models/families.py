"""The model families the engine serves, registered by ``model_type``.

A family is a model module (its ``nn.Module``, whose parameter names are the checkpoint's tensor
names) and a config adapter (config.json -> ``ModelConfig`` keyword arguments: layer kinds, cache
shapes, the shared modules' parameters, and the family's own frozen settings in
``ModelConfig.family``). Everything else (runner, scheduler, caches, drafters, CUDA graphs) only
reads ``ModelConfig``'s cache shapes and the model's forward contract:

    model(fb: ForwardBatch, caches: Caches) -> final-normed hidden states [T, D]
    model.follow(fb, caches) -> None: the forward's cache writes alone (a draft model at rest;
        ``HybridCausalLM``'s default runs the whole forward)
    model.compute_logits(hidden [L, D]) -> [L, V] float32
    model.reset_runtime_state(); model.read_expert_load() -> {module name: [tokens per expert]}
    model.keep_in_fp32 (loader suffixes kept float32), model.embedding_name (the tensor
    lm_head ties to)

so adding a family is one entry here, its module and its adapter. This module imports nothing
heavy: the config parser reads it before any model code is loaded.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    model_type: str
    architectures: tuple[str, ...]     # config.json ``architectures`` names (used when model_type is absent)
    model: str                         # "module:Class" of the causal LM
    config: str                        # "module:function" config.json dict -> ModelConfig kwargs

    def _load(self, ref: str):
        mod, _, name = ref.partition(":")
        return getattr(importlib.import_module(mod), name)

    def model_class(self):
        return self._load(self.model)

    def config_adapter(self):
        return self._load(self.config)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    Family("nemotron_h", ("NemotronHForCausalLM",), "hybrid_engine.models.nemotron_h:NemotronHForCausalLM",
           "hybrid_engine._config_parse:model_config_kwargs"),
    Family("bamba", ("BambaForCausalLM",), "hybrid_engine.models.bamba:BambaForCausalLM",
           "hybrid_engine.models.bamba:config_kwargs"),
    Family("granitemoehybrid", ("GraniteMoeHybridForCausalLM",),
           "hybrid_engine.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
           "hybrid_engine.models.granitemoehybrid:config_kwargs"),
    Family("falcon_h1", ("FalconH1ForCausalLM",), "hybrid_engine.models.falcon_h1:FalconH1ForCausalLM",
           "hybrid_engine.models.falcon_h1:config_kwargs"),
)}


def family_of(architectures) -> str | None:
    """model_type of the first registered architecture name in ``architectures`` (or None)."""
    for arch in architectures or ():
        for f in FAMILIES.values():
            if arch in f.architectures:
                return f.model_type
    return None
