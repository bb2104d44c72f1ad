"""The embedded default models: a small TRAINED Nemotron-H target (Mamba2, attention, MLP, MoE, plus
one MTP step) and a small hybrid draft model sharing its byte-level BPE tokenizer, shipped as
Hugging Face folders in ``hybrid_engine/data/default_target`` and ``data/default_draft`` and
materialised once into a cache folder; and the seeded synthetic model the tests build on.

The trained models come from ``python -m benchmarks.train --preset default`` (benchmarks/train/):
they were trained on Python source and docs of a standard library and installed packages, so they
complete code. ``default_model_dir()`` / ``default_draft_model_dir()`` return
``$HYBRID_ENGINE_CACHE/default-<hash>`` / ``default-draft-<hash>`` (or under
``~/.cache/hybrid-engine``), the hash covering the shipped files and a format version.

``synthetic_model_dir()`` returns ``synthetic-<hash>``: the earlier seeded random model
(``data/synthetic_model.json``: O(1)-scale weights from ``models.synthetic.sens_init_``, ``mtp.*``
tensors, and a byte-level BPE trained on ``data/tokenizer_corpus.txt``), for tests that need its
fixed shapes or random weights.

Every folder holds config.json, generation_config.json, model.safetensors, tokenizer.json /
tokenizer_config.json (pad 0, bos 1, eos 2, and a small chat template with an ``enable_thinking``
switch, ``CHAT_TEMPLATE``) and ``manifest.json`` (size and sha256 of every other file). It is
written to a temporary folder and renamed into place, so concurrent callers are safe. Every call
checks the folder against its manifest (the shipped files and the copy are hashed: about 30 MB, tens
of milliseconds); a folder with a missing, truncated or
altered file is moved aside and rebuilt.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_TARGET_DIR = DATA_DIR / "default_target"      # shipped trained target (with its MTP step)
DEFAULT_DRAFT_DIR = DATA_DIR / "default_draft"        # shipped trained draft model
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
CONFIG_FILE = DATA_DIR / "synthetic_model.json"       # the seeded synthetic model's description
CORPUS_FILE = DATA_DIR / "tokenizer_corpus.txt"       # the synthetic model's tokenizer corpus
FORMAT_VERSION = 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")   # ids 0, 1, 2 (NemotronH defaults)
MANIFEST = "manifest.json"
# role-tagged turns; the assistant turn opens a <think> block unless enable_thinking=False, in
# which case it is closed at once (the reasoning switch of the Nemotron 3 templates, in miniature)
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think></think>' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}")


def corpus_texts() -> list[str]:
    """The shipped tokenizer corpus, one paragraph per item."""
    text = CORPUS_FILE.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def train_tokenizer(vocab_size: int):
    """Deterministic byte-level BPE trained on the shipped corpus, wrapped as a
    ``PreTrainedTokenizerFast`` (left padding, no automatic BOS). Its size is <= vocab_size
    (== vocab_size when the corpus allows that many merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} for a byte-level BPE, "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus_texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tokenizer(out_dir, vocab_size: int):
    """Train (see ``train_tokenizer``) and save into ``out_dir``; returns the tokenizer."""
    tok = train_tokenizer(vocab_size)
    tok.save_pretrained(str(out_dir))
    return tok


def synthetic_config() -> dict:
    """The seeded synthetic model's description (``data/synthetic_model.json``)."""
    return json.loads(CONFIG_FILE.read_text(encoding="utf-8"))


def default_config() -> dict:
    """config.json of the shipped trained default target."""
    return json.loads((DEFAULT_TARGET_DIR / "config.json").read_text(encoding="utf-8"))


def _cache_root() -> Path:
    env = os.environ.get("HYBRID_ENGINE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybrid-engine"


def _synthetic_digest(cfg: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(cfg, sort_keys=True).encode())
    h.update(CORPUS_FILE.read_bytes())
    h.update(f"format={FORMAT_VERSION}".encode())
    h.update(CHAT_TEMPLATE.encode())
    return h.hexdigest()[:16]


def _shipped_files(src: Path) -> list[Path]:
    """Every file of a shipped model folder (sorted), after checking the required ones exist."""
    for name in REQUIRED_FILES:
        if not (src / name).is_file():
            raise RuntimeError(f"the package is incomplete: {src / name} is missing (reinstall hybrid-engine)")
    return sorted(p for p in src.iterdir() if p.is_file() and p.name != MANIFEST)


def _shipped_digest(src: Path) -> str:
    h = hashlib.sha256(f"format={FORMAT_VERSION}".encode())
    for p in _shipped_files(src):
        h.update(p.name.encode())
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()[:16]


def _build_synthetic(out_dir: Path, cfg: dict) -> None:
    from .models.synthetic import make_hf_model

    cfg = dict(cfg)
    seed = cfg.pop("seed")
    pattern = cfg.pop("pattern")
    cfg.pop("description", None)
    make_hf_model(out_dir, pattern, seed=seed, with_tokenizer=False, **cfg)
    tok = save_tokenizer(out_dir, cfg["vocab_size"])
    if len(tok) != cfg["vocab_size"]:
        raise RuntimeError(f"synthetic tokenizer has {len(tok)} tokens, config says vocab_size="
                           f"{cfg['vocab_size']}; update data/synthetic_model.json")


def _copy_shipped(src: Path):
    def build(out_dir: Path) -> None:
        for p in _shipped_files(src):
            shutil.copyfile(p, out_dir / p.name)
    return build


def _file_digest(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _write_manifest(folder: Path) -> None:
    files = {p.name: _file_digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps(files, indent=1, sort_keys=True) + "\n")


def cache_problem(folder: Path) -> str | None:
    """Why ``folder`` is not an intact default-model cache entry (None when it is)."""
    try:
        files = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return f"{MANIFEST} missing or unreadable"
    if not isinstance(files, dict) or "config.json" not in files:
        return f"{MANIFEST} is malformed"
    for name, want in files.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        try:
            if _file_digest(p) != want:
                return f"{name} differs from the manifest (size or sha256)"
        except OSError as e:
            return f"{name} is unreadable: {e}"
    return None


def _materialise(name: str, build) -> Path:
    """``<cache root>/<name>``, built by ``build(tmp_folder)`` when missing or damaged (see
    ``cache_problem``); atomic against concurrent callers."""
    root = _cache_root()
    final = root / name
    if final.is_dir():
        problem = cache_problem(final)
        if problem is None:
            return final
        logger.warning("default model cache %s is damaged (%s): rebuilding it", final, problem)
        aside = Path(tempfile.mkdtemp(prefix=".default-corrupt-", dir=root))
        try:
            os.rename(final, aside / "old")   # atomic; another caller may have moved it already
        except OSError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".default-tmp-", dir=root))
    try:
        build(tmp)
        _write_manifest(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.rename(tmp, final)            # atomic; fails if another caller won the race
        except OSError:
            if cache_problem(final) is not None:
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def default_model_dir() -> Path:
    """Folder of the embedded trained default target (with its MTP step), copied from the package
    on first use and again when the cached copy is damaged (see ``cache_problem``)."""
    return _materialise(f"default-{_shipped_digest(DEFAULT_TARGET_DIR)}", _copy_shipped(DEFAULT_TARGET_DIR))


def default_draft_model_dir() -> Path:
    """Folder of the embedded trained draft model (same tokenizer as the default target): what
    ``--spec draft_model`` uses with the default model when no draft folder is given."""
    return _materialise(f"default-draft-{_shipped_digest(DEFAULT_DRAFT_DIR)}", _copy_shipped(DEFAULT_DRAFT_DIR))


def synthetic_model_dir() -> Path:
    """Folder of the seeded synthetic model (random O(1)-scale weights; ``data/synthetic_model.json``),
    built on first use (offline, about a second). For tests that need its shapes or weights."""
    cfg = synthetic_config()
    return _materialise(f"synthetic-{_synthetic_digest(cfg)}", lambda out: _build_synthetic(out, cfg))
