"""A safetensors checkpoint folder as the loaders see it: which file holds each tensor
(``weight_files``: ``model.safetensors``; or ``model.safetensors.index.json`` and the shards it
names; or, without an index, every ``*.safetensors`` in the folder), opening a file with an error
that names it (``open_safetensors``), and how the checkpoint's tensor names map to the model's
(``canonical_names``: the backbone's ``backbone.`` / ``model.`` / no prefix). Shared by the
checkpoint loader (``loader.py``) and the quantized-checkpoint readers."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from safetensors import safe_open

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_LISTED = 10                                   # names listed in an error before "... (N more)"
BACKBONE = "backbone."
_ALT_BACKBONE = "model."
_NEVER_RENAMED = ("lm_head.", "mtp.")


def listing(names) -> str:
    names = sorted(names)
    shown = ", ".join(names[:MAX_LISTED])
    return shown + (f", ... ({len(names) - MAX_LISTED} more)" if len(names) > MAX_LISTED else "")


def weight_files(model_dir) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file holding it."""
    folder = Path(model_dir).expanduser()
    if not folder.is_dir():
        raise ValueError(f"model folder {folder} does not exist or is not a folder")
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from None
        files = {name: folder / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise ValueError(f"{index} names shard {f.name}, which is missing from {folder}")
        return files
    single = folder / SINGLE_FILE
    paths = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not paths:
        extra = " (found PyTorch *.bin weights: convert them to safetensors)" if any(folder.glob("*.bin")) else ""
        raise ValueError(f"no *.safetensors weight files in {folder}{extra}")
    files: dict[str, Path] = {}
    for p in paths:
        with open_safetensors(p) as f:
            for name in f.keys():
                if name in files:
                    raise ValueError(f"tensor {name} is stored twice: in {files[name].name} and {p.name}")
                files[name] = p
    return files


def open_safetensors(path: Path):
    """``safe_open`` with a ValueError naming the file when it is not valid safetensors."""
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:          # SafetensorError, OSError: truncated, garbage, unreadable
        raise ValueError(f"{path} is not a valid safetensors file (truncated or corrupt?): {e}") from None


def canonical_names(disk_names, model_names) -> dict[str, str]:
    """Map each on-disk tensor name to the name the model uses (see the module docstring:
    ``model.X`` or an unprefixed ``X`` -> ``backbone.X`` when the model's names carry ``backbone.``
    and the checkpoint's do not). Returns {disk name: model name}."""
    disk_names = list(disk_names)
    if not any(n.startswith(BACKBONE) for n in model_names):
        return {n: n for n in disk_names}
    own = [n for n in disk_names if not n.startswith(_NEVER_RENAMED)]
    if any(n.startswith(BACKBONE) for n in own):
        alt = [n for n in own if n.startswith(_ALT_BACKBONE)]
        if alt:
            raise ValueError(f"checkpoint mixes backbone.* and model.* tensor names (e.g. {alt[0]}); "
                             "a checkpoint uses one prefix for its backbone")
        return {n: n for n in disk_names}
    if any(n.startswith(_ALT_BACKBONE) for n in own):
        bare = [n for n in own if not n.startswith(_ALT_BACKBONE)]
        if bare:
            raise ValueError(f"checkpoint mixes model.* and unprefixed tensor names (e.g. {bare[0]}); "
                             "a checkpoint uses one prefix for its backbone")
        logger.info("checkpoint names its backbone tensors model.*: reading them as backbone.*")
        return {n: (BACKBONE + n[len(_ALT_BACKBONE):] if n in own else n) for n in disk_names}
    if own:
        logger.info("checkpoint's backbone tensors have no prefix: reading them as backbone.*")
    return {n: (BACKBONE + n if n in own else n) for n in disk_names}
