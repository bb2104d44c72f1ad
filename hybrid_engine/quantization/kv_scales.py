"""FP8 KV-cache scales: found in a checkpoint and handed to the KV cache that stores the codes.

A ModelOpt export with ``kv_cache_quant_algo: "FP8"`` stores, per attention layer, one float32
scale for K and one for V (value = code * scale; amax / 448 of the k_proj / v_proj outputs over its
calibration) as ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale``; other exporters write
``<attn>.k_scale`` / ``<attn>.v_scale``. Both spellings are read (one per layer; both is an error).
The weight loader reads past these tensors (``linear.IGNORED_SUFFIXES``); this module reads them
once at build time into ``KVCache.set_scales``, which keeps them as device tensors.

What a cache gets, as vLLM does: ``kv_cache_dtype="fp8"``: the checkpoint's scales for the layers
of that cache (all or none: a checkpoint with some layers' scales missing is refused), else 1.0 for
every layer, with one warning that values beyond +-448 saturate; ``kv_cache_dtype="auto"``: the
cache stays in the model dtype and stored scales are unused (``note_unused_kv_scales`` says so).
The target's layers, the MTP block's (``mtp.*``) and a draft model's each form their own cache.
"""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("hybrid_engine")

# accepted spellings under an attention module, ModelOpt's first
K_SCALE_NAMES = ("k_proj.k_scale", "k_scale")
V_SCALE_NAMES = ("v_proj.v_scale", "v_scale")


def _rank0() -> bool:
    """Log on rank 0 only: tensor-parallel workers build the same caches and would repeat it."""
    import torch.distributed as dist
    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def check_fp8_scale_format(quant, kv_cache_dtype: str, what: str = "checkpoint") -> None:
    """With an FP8 KV cache, a checkpoint's stored KV scales (``quant``: its QuantConfig or None)
    must describe FP8 codes: ``kv_cache_quant_algo`` None (no scales) or "FP8"; else ValueError."""
    algo = quant.kv_cache_quant_algo if quant is not None else None
    if algo is not None and algo != "FP8":
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} but the {what}'s kv_cache_quant_algo is {algo!r}: its "
                         "k_scale / v_scale are not FP8 scales (implemented: 'FP8'); use kv_cache_dtype='auto'")


def attention_module_names(model, *, mtp: bool = False) -> list[str]:
    """The model's attention modules (model naming) in attention-ordinal order: the backbone's, or
    with ``mtp`` the MTP block's (``mtp.*``)."""
    from ..models.nemotron_h import Attention
    found = {m.ordinal: n for n, m in model.named_modules()
             if isinstance(m, Attention) and n.startswith("mtp.") == mtp}
    return [found[i] for i in sorted(found)]


def read_kv_scales(model_dir, model, modules: list[str]) -> tuple[list[float], list[float]] | None:
    """([K scale], [V scale]) per module of ``modules`` as stored in ``model_dir``, or None when the
    checkpoint stores none for them. ValueError naming the tensors when only some are stored, a
    layer has both spellings, or a scale is not one positive finite number."""
    from ..models.checkpoint_files import canonical_names, listing, open_safetensors, weight_files
    files = weight_files(model_dir)
    disk_of = {m: d for d, m in canonical_names(files, model.state_dict(keep_vars=True)).items()}
    scales: dict[str, list[float]] = {"k": [], "v": []}
    missing, bad = [], []
    for mod in modules:
        for kind, names in (("k", K_SCALE_NAMES), ("v", V_SCALE_NAMES)):
            hits = [f"{mod}.{n}" for n in names if f"{mod}.{n}" in disk_of]
            if len(hits) > 1:
                raise ValueError(f"checkpoint {model_dir} stores the {kind.upper()} scale of {mod} twice: "
                                 f"{disk_of[hits[0]]} and {disk_of[hits[1]]}")
            if not hits:
                missing.append(f"{mod}.{names[0]}")
                continue
            disk = disk_of[hits[0]]
            with open_safetensors(files[disk]) as f:
                t = f.get_tensor(disk)
            ok = t.numel() == 1 and t.is_floating_point() and bool(torch.isfinite(t.float()).all()) \
                and float(t) > 0
            if not ok:
                bad.append(f"{disk} (shape {list(t.shape)}, {t.dtype})")
                continue
            scales[kind].append(float(t))
    if bad:
        raise ValueError(f"checkpoint {model_dir}: a KV-cache scale must be one positive finite float, got "
                         f"{listing(bad)}")
    if not scales["k"] and not scales["v"]:
        return None
    if missing:
        raise ValueError(f"checkpoint {model_dir} stores FP8 KV-cache scales for some attention layers but "
                         f"lacks {listing(missing)}")
    return scales["k"], scales["v"]


def attach_kv_scales(kv, model_dir, model, *, mtp: bool = False, what: str = "target") -> None:
    """Give an FP8 ``kv`` (``attention.KVCache``) the checkpoint's scales for ``model``'s attention
    layers (the backbone's, or the MTP block's), else leave them at 1.0 and warn once. A cache in
    the model dtype has no scales: nothing is read."""
    if not kv.quantized or kv.num_layers == 0:
        return
    modules = attention_module_names(model, mtp=mtp)
    if len(modules) != kv.num_layers:
        raise RuntimeError(f"{what} KV cache has {kv.num_layers} layers but the model has {len(modules)} "
                           "attention modules")
    found = read_kv_scales(model_dir, model, modules)
    if found is None:
        if _rank0():
            logger.warning("%s KV cache in %s with scale 1.0 for K and V: the checkpoint stores no k_scale / "
                           "v_scale, so K and V values beyond +-448 saturate", what, kv.dtype)
        return
    kv.set_scales(*found)
    if _rank0():
        logger.info("%s KV cache in %s with the checkpoint's per-layer scales: k %s, v %s", what, kv.dtype,
                    [f"{s:.4g}" for s in found[0]], [f"{s:.4g}" for s in found[1]])


def note_unused_kv_scales(cfg) -> None:
    """kv_cache_dtype "auto" on a checkpoint that declares an FP8 KV cache: say (once, rank 0) that
    its scales are unused and how to use them."""
    stored = cfg.model.quantization
    algo = stored.kv_cache_quant_algo if stored is not None else None
    if algo is not None and not cfg.cache.kv_fp8 and _rank0():
        hint = " (kv_cache_dtype='fp8' reads them)" if str(algo).upper() == "FP8" else ""
        logger.info("the checkpoint declares a %s KV cache (kv_cache_quant_algo): kv_cache_dtype='auto' keeps K "
                    "and V in %s and its k_scale / v_scale are unused%s", algo, cfg.dtype, hint)
