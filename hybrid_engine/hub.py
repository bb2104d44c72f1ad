"""Model location: a local folder, or a Hugging Face Hub repo id fetched with ``huggingface_hub``.

``resolve_model_dir("nvidia/NVIDIA-Nemotron-Nano-9B-v2")`` downloads the repo's config, tokenizer,
generation config and safetensors weights into the Hub cache (``HF_HUB_CACHE``, default
``~/.cache/huggingface/hub``) with ``snapshot_download`` and returns the snapshot folder. With
``HF_HUB_OFFLINE=1`` nothing is downloaded: the cached snapshot is used, or a ValueError says it
is not cached. A string that is neither an existing folder nor shaped like a repo id
(``owner/name``) is a ValueError saying the folder does not exist.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# files the engine reads; everything else in a repo (other formats, images, code) is skipped
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = ("1", "true", "yes", "on")


def looks_like_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve_model_dir(model) -> Path:
    """A local model folder for ``model`` (a folder path or a Hub repo id)."""
    if not isinstance(model, (str, os.PathLike)):
        raise ValueError(f"model must be a folder path or a Hugging Face Hub repo id, got {model!r}")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ValueError(f"model {str(model)!r} is a file, not a model folder (a folder with "
                         "config.json and *.safetensors weights)")
    name = str(model)
    if not looks_like_repo_id(name):
        raise ValueError(f"model folder {name!r} does not exist (give a folder with config.json and "
                         "*.safetensors weights, or a Hugging Face Hub repo id such as "
                         "'nvidia/NVIDIA-Nemotron-Nano-9B-v2')")
    from huggingface_hub import snapshot_download

    offline = _offline()
    try:
        folder = snapshot_download(repo_id=name, allow_patterns=ALLOW_PATTERNS,
                                   cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                   local_files_only=offline)
    except Exception as e:       # not found, offline and not cached, network, gated repo
        where = "in the local Hub cache (HF_HUB_OFFLINE=1)" if offline else "on the Hugging Face Hub"
        raise ValueError(f"model {name!r} is not a local folder and was not found {where}: "
                         f"{type(e).__name__}: {e}") from None
    logger.info("model %s -> %s", name, folder)
    return Path(folder)
