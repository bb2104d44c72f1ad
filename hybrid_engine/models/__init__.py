"""Model definitions and construction."""
from __future__ import annotations

import torch


def build_model(model_cfg, model_dir, dtype: torch.dtype, device: torch.device, with_mtp: bool = False):
    """Construct Nemotron-H without initialising weights, then fill them from the checkpoint."""
    from .loader import load_checkpoint
    from .nemotron_h import NemotronHForCausalLM
    # parameters are born in the serving dtype, so no float32 copy of the model is ever allocated
    # (a 30B model would need 120 GB for it); explicit float32 buffers stay float32
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = NemotronHForCausalLM(model_cfg, with_mtp=with_mtp)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device=device).to(dtype)
    load_checkpoint(model, model_dir, dtype, device)
    model.reset_runtime_state()      # buffers outside the checkpoint (to_empty left them unset)
    return model.eval()
