"""Load a safetensors checkpoint into a model whose parameter names are the on-disk names.

Which file holds which tensor, and how disk names map to the model's, is ``checkpoint_files.py``.
Layout read: ``model.safetensors``; or ``model.safetensors.index.json`` + the shards it names; or,
without an index, every ``*.safetensors`` in the folder. Tensors are read one at a time with
``safetensors.safe_open`` and copied into the model's tensors, so peak memory stays about one
tensor above the model itself.

Name mapping (disk -> model), checked for every tensor before anything is copied:
- same name: copied (cast to the target dtype);
- merged experts on disk, ``<p>.experts.up_proj`` [E, F, D] / ``<p>.experts.down_proj`` [E, D, F],
  split into the model's ``<p>.experts.{e}.up_proj.weight`` / ``.down_proj.weight``; and the
  reverse (per-expert on disk, merged 3-D parameter in the model) is stacked;
- ``mtp.*`` tensors when the model has no ``mtp.*`` tensor: skipped (debug log);
- backbone prefix: the model's names start with ``backbone.`` (as published checkpoints store
  them); a checkpoint whose backbone tensors are named ``model.*`` (transformers' in-memory naming)
  or carry no prefix (``embeddings.weight``, ``layers.N.*``, ``norm_f.weight``) is read as if they
  were ``backbone.*`` (``lm_head.*`` and ``mtp.*`` are never renamed); mixing spellings is an error;
- ``lm_head.weight`` absent and tied embeddings: the model's lm_head shares the embedding weight
  (``model.embedding_name``, default ``backbone.embeddings.weight``).
  When the checkpoint has its own ``lm_head.weight`` it is used, tie or not (transformers'
  NemotronH never ties: ``_tied_weights_keys = {}``), untying a shared model parameter.

Stored dtypes: float16, bfloat16, float32 and float64 tensors are read (cast to the target dtype);
a float8_e4m3fn or uint8 tensor only into a model tensor of the same dtype (the quantized layers of
``hybrid_engine.quantization``, which list their weight and scales in ``fixed_dtype_params``: the
loader never casts those). Any other float8, integer or packed tensor is a ValueError naming it (the
engine never casts quantized data silently). Names ending in the model's
``ignored_checkpoint_suffixes`` (e.g. ModelOpt's KV-cache ``.k_scale``) are skipped, as are the
names in the model's ``ignored_checkpoint_names`` (e.g. quantized experts' unused input scales). Per-expert
scales of quantized experts (``<p>.experts.<e>.up_proj.weight_scale`` / ``.weight_scale_2``) are
stacked into the merged ``<p>.experts.up_proj_weight_scale`` / ``_weight_scale_2``. A file that is not
valid safetensors (truncated, garbage) is a ValueError naming the file. After loading, every
floating tensor is checked for NaN / inf with one sum per tensor on the device and a single host
read for all of them; a non-finite tensor is a ValueError naming it.

Precision: with ``dtype`` given, floating tensors end in ``dtype`` except the names listed by the
model's ``keep_in_fp32`` attribute (suffixes; default ``("e_score_correction_bias",)``), which end
in float32. With ``dtype=None`` every tensor keeps the dtype the model gave it (A_log, D, dt_bias
are loaded as stored; the model decides their precision). Tensors on the meta device are
materialised on ``device``.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint_files import MAX_LISTED, canonical_names, listing, open_safetensors, weight_files

logger = logging.getLogger(__name__)

DEFAULT_KEEP_IN_FP32 = ("e_score_correction_bias",)
LM_HEAD, DEFAULT_EMBED = "lm_head.weight", "backbone.embeddings.weight"
_MERGED = re.compile(r"^(?P<p>.*\.experts)\.(?P<w>up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<w>up_proj|down_proj)\.weight$")
# per-expert weight scales of quantized experts -> the merged [E, ...] tensor "<p>.experts.<w>_<s>"
# (s: FP8's per-tensor weight_scale; NVFP4's block weight_scale and per-tensor weight_scale_2)
_PER_EXPERT_SCALE = re.compile(
    r"^(?P<p>.*\.experts)\.(?P<e>\d+)\.(?P<w>up_proj|down_proj)\.(?P<s>weight_scale(_2)?)$")
_MERGED_SCALE = re.compile(r"^.*\.experts\.(up_proj|down_proj)_weight_scale(_2)?$")
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")      # safetensors dtype codes this loader reads
# quantized storage, read only into a model tensor of the same dtype (a quantized layer's)
_CODES = {torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}


@dataclass
class _Copy:
    disk: str          # on-disk tensor name
    target: str        # model state_dict name
    index: int | None  # expert index into a 3-D tensor (None: whole tensor)
    split: bool        # True: disk tensor is 3-D and is split into per-expert targets


def _has_fp32_name(name: str, keep: tuple[str, ...]) -> bool:
    return any(name == k or name.endswith("." + k) for k in keep)


def _tie_requested(model, model_dir: Path, tie: bool | None) -> bool:
    if tie is not None:
        return tie
    for attr in ("cfg", "config"):
        cfg = getattr(model, attr, None)
        if cfg is not None and hasattr(cfg, "tie_word_embeddings"):
            return bool(cfg.tie_word_embeddings)
    try:
        return bool(json.loads((model_dir / "config.json").read_text()).get("tie_word_embeddings", False))
    except (OSError, json.JSONDecodeError):
        return False


def _plan(targets: dict, files: dict, shapes: dict, strict_prefixes, has_mtp: bool,
          ignored: tuple[str, ...] = ()):
    """-> (copies, consumed target names, unexpected disk names)."""
    copies: list[_Copy] = []
    covered: set[str] = set()
    unexpected: list[str] = []
    for name in files:
        if strict_prefixes is not None and not name.startswith(tuple(strict_prefixes)):
            logger.debug("skipping %s (outside strict_prefixes %s)", name, strict_prefixes)
            continue
        if name in targets:
            copies.append(_Copy(name, name, None, False))
            covered.add(name)
            continue
        m, per = _MERGED.match(name), _per_expert_target(name)
        if m and f"{m['p']}.0.{m['w']}.weight" in targets:
            for e in range(shapes[name][0] if shapes[name] else 0):
                t = f"{m['p']}.{e}.{m['w']}.weight"
                if t not in targets:
                    unexpected.append(f"{name}[{e}]")
                    continue
                copies.append(_Copy(name, t, e, True))
                covered.add(t)
        elif per and per[0] in targets:                 # one expert's weight or scale -> its row
            t, e = per
            if e >= targets[t].shape[0]:
                unexpected.append(name)
                continue
            copies.append(_Copy(name, t, e, False))
            covered.add(f"{t}[{e}]")
        elif name.startswith("mtp.") and not has_mtp:
            logger.debug("ignoring %s: the model has no MTP module", name)
        elif name.endswith(ignored):
            logger.debug("ignoring %s (the model reads past tensors ending in %s)", name, ignored)
        else:
            unexpected.append(name)
    for t, tensor in targets.items():      # a merged target is covered when every expert is
        if t not in covered and ((tensor.dim() == 3 and _MERGED.match(t)) or _MERGED_SCALE.match(t)):
            if all(f"{t}[{e}]" in covered for e in range(tensor.shape[0])):
                covered.add(t)
    return copies, covered, unexpected


def _per_expert_target(name: str) -> tuple[str, int] | None:
    """(the merged [E, ...] target, the expert) of a per-expert disk tensor: a weight
    (``_PER_EXPERT``) or a scale (``_PER_EXPERT_SCALE``); None for any other name."""
    pe = _PER_EXPERT.match(name)
    if pe:
        return f"{pe['p']}.{pe['w']}", int(pe["e"])
    ps = _PER_EXPERT_SCALE.match(name)
    return (f"{ps['p']}.{ps['w']}_{ps['s']}", int(ps["e"])) if ps else None


def _expected_shape(c: _Copy, targets, shards=None) -> tuple[int, ...]:
    """The disk shape ``c`` needs (with ``shards``: the full tensor this rank's part comes from)."""
    shape = tuple(targets[c.target].shape)
    if shards and c.target in shards:
        shape = shards[c.target].full_shape(shape)
    return shape[1:] if (c.index is not None and not c.split) else shape


def _found_shape(c: _Copy, shapes) -> tuple[int, ...]:
    return shapes[c.disk][1:] if c.split else shapes[c.disk]


def _target_dtype(name: str, targets: dict) -> torch.dtype | None:
    """The dtype of the model tensor disk tensor ``name`` is read into (merged experts included)."""
    if name in targets:
        return targets[name].dtype
    per = _per_expert_target(name)
    t = targets.get(per[0]) if per else None
    return t.dtype if t is not None else None


def _fixed_dtype(model: torch.nn.Module, name: str) -> bool:
    """True for a tensor whose module fixes its dtype (a quantized layer's weight and scales)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    return attr in getattr(mod, "fixed_dtype_params", ())


def _replace(model: torch.nn.Module, name: str, new: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        mod._parameters[attr] = torch.nn.Parameter(new, requires_grad=False)
    else:
        mod._buffers[attr] = new


def load_checkpoint(model: torch.nn.Module, model_dir, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, strict_prefixes: tuple[str, ...] | None = None,
                    *, tie_word_embeddings: bool | None = None, progress: bool | None = None,
                    shards: dict | None = None) -> torch.nn.Module:
    """Fill ``model``'s parameters and persistent buffers from ``model_dir``; returns ``model``.

    ``strict_prefixes``: None (default) checks the whole checkpoint: every model tensor must be
    found and every disk tensor used (``mtp.*`` excepted when the model has no MTP). With a tuple,
    only disk tensors and model tensors whose names start with one of the prefixes take part
    (e.g. ``("mtp.",)`` to fill an MTP module); others are left alone.
    ``tie_word_embeddings``: None reads it from ``model.cfg`` / ``model.config`` or config.json.
    ``progress``: show a tqdm bar over files (default: when there is more than one file).
    ``shards``: {model tensor name: ``parallel.sharding.Shard``} under tensor parallelism: that
    tensor holds this rank's part of the checkpoint tensor (shapes are checked against the full
    one; each tensor is read whole, one at a time, and only its part is copied to the device).
    Errors (ValueError, raised before anything is copied): missing tensors (up to 10 listed),
    shape mismatches (expected vs found), unexpected tensors, no weight files in the folder.
    """
    folder = Path(model_dir).expanduser()
    disk_files = weight_files(folder)
    device = torch.device(device) if device is not None else None
    keep32 = tuple(getattr(model, "keep_in_fp32", DEFAULT_KEEP_IN_FP32))
    EMBED = getattr(model, "embedding_name", DEFAULT_EMBED)     # the tensor a tied lm_head shares

    full_sd = model.state_dict(keep_vars=True)
    renamed = canonical_names(disk_files, full_sd)          # disk name -> model name
    files = {renamed[n]: p for n, p in disk_files.items()}  # model-side name -> file
    disk_name = {m: d for d, m in renamed.items()}          # model-side name -> disk name
    targets = dict(full_sd)
    if strict_prefixes is not None:
        targets = {k: v for k, v in targets.items() if k.startswith(tuple(strict_prefixes))}
    has_mtp = any(k.startswith("mtp.") for k in full_sd)
    read_past = set(getattr(model, "ignored_checkpoint_names", ()))      # e.g. unused scales
    tie = shared_on_disk = False
    if LM_HEAD in targets and EMBED in full_sd:
        if LM_HEAD not in files:
            # lm_head shares the embeddings only when the checkpoint has no lm_head of its own
            tie = _tie_requested(model, folder, tie_word_embeddings)
            if tie:
                targets.pop(LM_HEAD)
        elif full_sd[LM_HEAD] is full_sd[EMBED] and EMBED in targets:
            # both on disk while the model shares them: keep the tie if the stored lm_head equals
            # the embeddings, else untie (transformers' NemotronH never ties, it reads lm_head.weight)
            shared_on_disk = True
            targets.pop(LM_HEAD)

    shapes: dict[str, tuple[int, ...]] = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    not_float: list[str] = []
    for path, names in by_file.items():
        with open_safetensors(path) as f:
            for name in names:
                sl = f.get_slice(disk_name[name])
                shapes[name] = tuple(sl.get_shape())
                stored_as_target = _CODES.get(_target_dtype(name, targets)) == sl.get_dtype()
                skipped = (name in read_past or (name.startswith("mtp.") and not has_mtp)
                           or (strict_prefixes is not None and not name.startswith(tuple(strict_prefixes))))
                if sl.get_dtype() not in FLOAT_DTYPES and not stored_as_target and not skipped:
                    not_float.append(f"{disk_name[name]} ({sl.get_dtype()}, in {path.name})")
    if not_float:
        raise ValueError(f"checkpoint {folder} stores {len(not_float)} tensor(s) in a dtype this engine "
                         f"does not load (allowed: float16, bfloat16, float32, float64; quantized "
                         f"float8 / FP4 tensors are read only into the quantized layers of a "
                         f"ModelOpt FP8 / NVFP4 checkpoint): {listing(not_float)}")

    plan_files = {k: v for k, v in files.items() if not (shared_on_disk and k == LM_HEAD) and k not in read_past}
    copies, covered, unexpected = _plan(targets, plan_files, shapes, strict_prefixes, has_mtp,
                                        tuple(getattr(model, "ignored_checkpoint_suffixes", ())))
    shards = shards or {}
    lm_full_shape = tuple(full_sd[LM_HEAD].shape) if LM_HEAD in full_sd else ()
    if LM_HEAD in shards:
        lm_full_shape = shards[LM_HEAD].full_shape(lm_full_shape)
    if shared_on_disk and shapes[LM_HEAD] != lm_full_shape:
        raise ValueError(f"shape mismatch in checkpoint {folder}: {LM_HEAD}: expected "
                         f"{list(lm_full_shape)}, found {list(shapes[LM_HEAD])}")
    if unexpected:
        raise ValueError(f"checkpoint {folder} has {len(unexpected)} tensor(s) the model does not have: "
                         f"{listing(unexpected)}")
    missing = [t for t in targets if t not in covered]
    if missing:
        raise ValueError(f"checkpoint {folder} lacks {len(missing)} tensor(s) the model needs: "
                         f"{listing(missing)}")
    bad = [f"{c.disk}: expected {list(_expected_shape(c, targets, shards))}, found {list(_found_shape(c, shapes))}"
           for c in copies if _expected_shape(c, targets, shards) != _found_shape(c, shapes)]
    if bad:
        raise ValueError(f"shape mismatch in checkpoint {folder}: " + "; ".join(sorted(set(bad))[:MAX_LISTED]))

    # Materialise / convert the targets: meta tensors, wrong device, or wrong floating dtype.
    for name, t in targets.items():
        want_dtype = t.dtype
        if t.is_floating_point() and not _fixed_dtype(model, name):
            if _has_fp32_name(name, keep32):
                want_dtype = torch.float32
            elif dtype is not None:
                want_dtype = dtype
        want_device = device if device is not None else (t.device if t.device.type != "meta" else torch.device("cpu"))
        if t.device.type == "meta" or t.device != want_device or t.dtype != want_dtype:
            new = torch.empty(t.shape, dtype=want_dtype, device=want_device)
            if t.device.type != "meta":
                new.copy_(t.detach())
            _replace(model, name, new)
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items() if k in targets}

    by_disk_file: dict[Path, dict[str, list[_Copy]]] = {}
    for c in copies:
        by_disk_file.setdefault(files[c.disk], {}).setdefault(c.disk, []).append(c)
    paths = sorted(by_disk_file)
    show = progress if progress is not None else len(paths) > 1
    if show:
        from tqdm.auto import tqdm
        paths = tqdm(paths, desc="Loading weights", unit="file")
    with torch.no_grad():
        for path in paths:
            with open_safetensors(path) as f:
                for name, group in by_disk_file[path].items():
                    src = f.get_tensor(disk_name[name])
                    for c in group:
                        dst = targets[c.target]
                        shard = shards.get(c.target)
                        if c.split:
                            if shard is not None:
                                raise ValueError(f"{c.target}: a per-expert tensor cannot be split by "
                                                 f"tensor parallelism")
                            dst.copy_(src[c.index])
                        elif c.index is not None:
                            dst[c.index].copy_(src if shard is None else shard.take(src, offset=1))
                        else:
                            dst.copy_(src if shard is None else shard.take(src))
                    del src

    lm = model.get_submodule(LM_HEAD.rpartition(".")[0]) if (tie or shared_on_disk) else None
    if tie and lm.weight is not model.get_parameter(EMBED):
        lm.weight = model.get_parameter(EMBED)
    if shared_on_disk:
        emb = model.get_parameter(EMBED)
        lm.weight = emb      # materialisation above may have replaced the embedding parameter
        with open_safetensors(files[LM_HEAD]) as f:
            stored = f.get_tensor(disk_name[LM_HEAD])
            if LM_HEAD in shards:
                stored = shards[LM_HEAD].take(stored)
            stored = stored.to(device=emb.device, dtype=emb.dtype)
        if not torch.equal(stored, emb.detach()):
            logger.info("checkpoint's %s differs from %s: untying them", LM_HEAD, EMBED)
            lm.weight = torch.nn.Parameter(stored, requires_grad=False)
    check_finite(model, {c.target: disk_name[c.disk] for c in copies}, folder)
    return model


@torch.no_grad()
def check_finite(model: torch.nn.Module, names: dict[str, str], folder) -> None:
    """ValueError naming the tensors of ``names`` ({model name: disk name}) holding NaN or inf.

    One sum per tensor on its device, in the tensor's own dtype so no converted copy is made (a NaN
    or inf anywhere makes the sum non-finite), and one host read for all of them; a flagged tensor
    is confirmed element-wise, so a finite tensor whose sum merely overflows is not reported."""
    sd = model.state_dict(keep_vars=True)
    tensors = [(n, sd[n]) for n in names if n in sd and sd[n].is_floating_point()]
    if not tensors:
        return
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for n, t in tensors:
        by_device.setdefault(t.device, []).append((n, t))
    bad = []
    for items in by_device.values():
        # float8 has no sum kernel: those (1-byte) tensors are summed as float32
        sums = torch.stack([(t.detach().float() if t.element_size() == 1 else t.detach()).sum().float()
                            for _, t in items])
        flags = torch.isfinite(sums).cpu()                       # the one host read per device
        for (n, t), ok in zip(items, flags.tolist()):
            if not ok and not bool(torch.isfinite(t.detach()).all()):
                bad.append(names[n])
    if bad:
        raise ValueError(f"checkpoint {folder} has NaN or inf values in {len(set(bad))} tensor(s): "
                         f"{listing(set(bad))}")
