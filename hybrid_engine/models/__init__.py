"""Model definitions and construction."""
from __future__ import annotations

import torch

_FROM_CONFIG = object()


def build_model(model_cfg, model_dir, dtype: torch.dtype, device: torch.device, with_mtp: bool = False,
                quantization=_FROM_CONFIG, tp=None):
    """Construct the model of ``model_cfg.model_type`` (its family's class, ``families.py``)
    without initialising weights, then fill them from the checkpoint.

    ``quantization``: a ``QuantConfig`` or None; by default the checkpoint's own
    (``model_cfg.quantization``). Source "checkpoint": the layers stored quantized are swapped for
    quantized modules before loading; source "online": linear layers are quantized after loading
    (``hybrid_engine.quantization.linear.quantize_linears``). Nemotron-H only so far.

    ``tp``: a ``parallel.group.TPGroup``: build this rank's part (``parallel/sharding.py``) and read
    only its part of each checkpoint tensor. ``model_cfg`` is the full model's config."""
    from .families import FAMILIES
    from .loader import load_checkpoint
    model_class = FAMILIES[model_cfg.model_type].model_class()
    if with_mtp and not getattr(model_class, "supports_mtp", False):
        raise ValueError(f"speculative method 'mtp' is not available for model_type {model_cfg.model_type!r}")
    q = model_cfg.quantization if quantization is _FROM_CONFIG else quantization
    if q is not None:
        if model_cfg.model_type != "nemotron_h":
            raise ValueError(f"quantization {q.method!r} is not available for model_type "
                             f"{model_cfg.model_type!r} (only 'nemotron_h' so far)")
        from hybrid_engine.quantization.config import check_supported
        check_supported(q, torch.device(device), dtype)
    # parameters are born in the serving dtype, so no float32 copy of the model is ever allocated
    # (a 30B model would need 120 GB for it); explicit float32 buffers stay float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        shards = None
        with torch.device("meta"):
            if tp is None:
                model = model_class(model_cfg, with_mtp=with_mtp)
            else:
                from ..parallel.sharding import TPLayout, apply_tensor_parallel, shard_model_config
                model = model_class(shard_model_config(model_cfg, tp.size), with_mtp=with_mtp)
                shards = apply_tensor_parallel(model, TPLayout(rank=tp.rank, size=tp.size, full=model_cfg), tp,
                                               dtype=dtype)
            if q is not None and q.source == "checkpoint":
                from hybrid_engine.quantization.linear import quantize_linears
                from hybrid_engine.quantization.stored import stored_quantized
                quantize_linears(model, q, stored_quantized(model_dir, model, q))
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device).to(dtype)
    load_checkpoint(model, model_dir, dtype, device, shards=shards)
    if q is not None and q.source == "online":
        from hybrid_engine.quantization.linear import quantize_linears
        quantize_linears(model, q)
        if torch.device(device).type == "cuda":
            # the freed 16-bit weights go back to the device: the KV budget is a share of free memory
            torch.cuda.empty_cache()
    model.reset_runtime_state()      # buffers outside the checkpoint (to_empty left them unset)
    return model.eval()
