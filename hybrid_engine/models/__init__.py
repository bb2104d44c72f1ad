"""Model definitions and construction."""
from __future__ import annotations

import torch


def build_model(model_cfg, model_dir, dtype: torch.dtype, device: torch.device, with_mtp: bool = False):
    """Construct the model of ``model_cfg.model_type`` (its family's class, ``families.py``)
    without initialising weights, then fill them from the checkpoint."""
    from .families import FAMILIES
    from .loader import load_checkpoint
    model_class = FAMILIES[model_cfg.model_type].model_class()
    if with_mtp and not getattr(model_class, "supports_mtp", False):
        raise ValueError(f"speculative method 'mtp' is not available for model_type {model_cfg.model_type!r}")
    # parameters are born in the serving dtype, so no float32 copy of the model is ever allocated
    # (a 30B model would need 120 GB for it); explicit float32 buffers stay float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_class(model_cfg, with_mtp=with_mtp)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device).to(dtype)
    load_checkpoint(model, model_dir, dtype, device)
    model.reset_runtime_state()      # buffers outside the checkpoint (to_empty left them unset)
    return model.eval()
