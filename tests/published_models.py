"""Reduced-size copies of the published Nemotron-H checkpoints, for tests.

``tests/fixtures/published_configs.json`` holds each release's config.json as published (with its
Hub repo and where the values come from). ``make_published_model`` writes a checkpoint folder whose
config.json is that file with only the widths shrunk (``SHRINK``): every key, the exact layer
pattern (``hybrid_override_pattern``), the expert count and top-k, ``time_step_min`` (0.001) and the
legacy spellings (``attention_head_dim``, ``torch_dtype``) are kept. The weights are transformers'
``NemotronHForCausalLM`` re-initialised with O(1)-scale values (``sens_init_``), stored under
``backbone.`` with per-expert MoE tensors like the published files, plus ``mtp.*`` tensors where
the release has MTP layers.

dt: transformers clamps dt = softplus(dt_proj + dt_bias) to ``time_step_min`` on its multi-token
path only, the engine (like the Mamba2 kernels) uses ``time_step_limit`` = (0, inf) everywhere. With
``dt_safe=True`` (default) the dt rows of every ``in_proj`` are scaled by ``DT_ROW_SCALE`` and
``dt_bias`` is drawn so that softplus(dt_bias) lies in ``DT_SAFE_RANGE``; dt then stays far above
0.001 on any input, so the clamp never fires and transformers agrees with itself (prefill vs
token-by-token) and with the engine. ``hf_dt_values`` checks that in the tests. ``dt_safe=False``
keeps the plain O(1) init, under which a fraction of dt values fall below 0.001.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "published_configs.json"
NAMES = ("h8b", "h47b", "nano9b_v2", "nano12b_v2", "nemotron3_nano30b", "nemotron3_super120b")
MTP_NAMES = ("nemotron3_super120b",)
MOE_NAMES = ("nemotron3_nano30b", "nemotron3_super120b")

# width -> reduced value (keys absent from a config are not added)
SHRINK = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, mamba_num_heads=16, mamba_head_dim=8, ssm_state_size=16,
              chunk_size=16, moe_intermediate_size=16, moe_shared_expert_intermediate_size=32,
              moe_latent_size=32)
DT_ROW_SCALE = 0.05
DT_SAFE_RANGE = (1e-2, 1e-1)


def published(name: str) -> dict:
    """The fixture entry: {"repo", "url", "source", "config"} (config as published)."""
    return json.loads(FIXTURES.read_text())[name]


def reduced_config(name: str, **overrides) -> dict:
    """The published config.json with the widths of ``SHRINK`` (and ``overrides``) applied."""
    cfg = dict(published(name)["config"])
    for k, v in {**SHRINK, **overrides}.items():
        if k in cfg or k in overrides:
            cfg[k] = v
    return cfg


def _hf_config(cfg: dict):
    from transformers import NemotronHConfig
    kw = {k: v for k, v in cfg.items() if k not in ("auto_map", "architectures", "transformers_version")}
    return NemotronHConfig(**kw)


@torch.no_grad()
def _make_dt_safe(sd: dict, num_heads: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed + 4242)
    lo, hi = (math.log(x) for x in DT_SAFE_RANGE)
    for name in sorted(sd):
        if name.endswith("mixer.dt_bias"):
            dt0 = torch.exp(lo + (hi - lo) * torch.rand(sd[name].shape, generator=g))
            sd[name] = (dt0 + torch.log(-torch.expm1(-dt0))).to(sd[name].dtype)   # softplus^-1
            w = sd[name.replace("dt_bias", "in_proj.weight")].clone()
            w[-num_heads:] *= DT_ROW_SCALE
            sd[name.replace("dt_bias", "in_proj.weight")] = w


def rename_prefix(sd: dict, prefix: str) -> dict:
    """``backbone.X`` -> ``prefix + X`` (lm_head.* and mtp.* unchanged)."""
    return {(prefix + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in sd.items()}


def make_published_model(out_dir, name: str, *, seed: int = 0, dt_safe: bool = True,
                         prefix: str = "backbone.", **overrides) -> Path:
    """Write the reduced ``name`` checkpoint into ``out_dir`` (config.json in the published form,
    model.safetensors, generation_config.json as transformers writes it); returns the folder."""
    from safetensors.torch import save_file
    from transformers import NemotronHForCausalLM

    from hybrid_engine.models.synthetic import _quiet_transformers, make_mtp_tensors, sens_init_, split_experts

    out_dir = Path(out_dir)
    cfg = reduced_config(name, **overrides)
    hf_cfg = _hf_config(cfg)
    torch.manual_seed(seed)
    with _quiet_transformers():
        model = NemotronHForCausalLM(hf_cfg).float().eval()
    sens_init_(model, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    with _quiet_transformers():
        model.save_pretrained(out_dir)            # config.json + generation_config.json + weights
    from safetensors.torch import load_file
    sd = load_file(str(out_dir / "model.safetensors"))
    sd = split_experts(sd)
    if cfg.get("num_nextn_predict_layers", 0) > 0:
        sd.update(make_mtp_tensors(hf_cfg, seed))
    if dt_safe:
        _make_dt_safe(sd, cfg["mamba_num_heads"], seed)
    sd = {k: v.contiguous() for k, v in rename_prefix(sd, prefix).items()}
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out_dir


def copy_with_prefix(src, dst, prefix: str) -> Path:
    """A copy of checkpoint folder ``src`` whose ``backbone.*`` tensors are renamed to ``prefix*``."""
    import shutil

    from safetensors.torch import load_file, save_file
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    sd = rename_prefix(load_file(str(src / "model.safetensors")), prefix)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
