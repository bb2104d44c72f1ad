"""The embedded default model: a small seeded Nemotron-H plus a byte-level BPE tokenizer, built
offline from files shipped in ``hybrid_engine/data`` and materialised once into a cache folder.

``default_model_dir()`` returns ``$HYBRID_ENGINE_CACHE/default-<hash>`` (or
``~/.cache/hybrid-engine/default-<hash>``), where the hash covers the config, the seed, the
tokenizer corpus and a format version. The folder holds config.json, generation_config.json,
model.safetensors (O(1)-scale weights from ``models.synthetic.sens_init_``, plus ``mtp.*`` tensors when the
config has MTP layers), tokenizer.json / tokenizer_config.json (pad 0, bos 1, eos 2, and a small
chat template with an ``enable_thinking`` switch, ``CHAT_TEMPLATE``) and ``manifest.json`` (size and
sha256 of every other file). It is written to a temporary folder and renamed into place, so
concurrent callers are safe. Every call checks the folder against its manifest (a few MB hashed);
a folder with a missing, truncated or altered file is moved aside and rebuilt. The weights are
random: the text it generates is gibberish, but it exercises every code path.
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
CONFIG_FILE = DATA_DIR / "default_model.json"
CORPUS_FILE = DATA_DIR / "tokenizer_corpus.txt"
FORMAT_VERSION = 2
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


def default_config() -> dict:
    """The shipped default model description (``data/default_model.json``)."""
    return json.loads(CONFIG_FILE.read_text(encoding="utf-8"))


def _cache_root() -> Path:
    env = os.environ.get("HYBRID_ENGINE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybrid-engine"


def _digest(cfg: dict) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(cfg, sort_keys=True).encode())
    h.update(CORPUS_FILE.read_bytes())
    h.update(f"format={FORMAT_VERSION}".encode())
    h.update(CHAT_TEMPLATE.encode())
    return h.hexdigest()[:16]


def _build(out_dir: Path, cfg: dict) -> None:
    from .models.synthetic import make_hf_model

    cfg = dict(cfg)
    seed = cfg.pop("seed")
    pattern = cfg.pop("pattern")
    cfg.pop("description", None)
    make_hf_model(out_dir, pattern, seed=seed, with_tokenizer=False, **cfg)
    tok = save_tokenizer(out_dir, cfg["vocab_size"])
    if len(tok) != cfg["vocab_size"]:
        raise RuntimeError(f"default tokenizer has {len(tok)} tokens, config says vocab_size="
                           f"{cfg['vocab_size']}; update data/default_model.json")


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


def default_model_dir() -> Path:
    """Folder of the embedded default model, built on first use (offline, about a second) and
    rebuilt when the cached copy is damaged (see ``cache_problem``)."""
    cfg = default_config()
    root = _cache_root()
    final = root / f"default-{_digest(cfg)}"
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
        _build(tmp, cfg)
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
