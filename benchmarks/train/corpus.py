"""The training corpus: Python source and docs every machine has (the interpreter's standard library
and its installed packages), split into train and held-out BY FILE.

Files: ``.py .rst .txt .md`` under the ``sysconfig`` paths ``stdlib`` (its ``site-packages`` /
``dist-packages`` subfolders excluded: they are walked as ``purelib``/``platlib``), ``purelib``
and ``platlib``, skipping ``__pycache__`` and files over ``max_file_bytes`` or not valid UTF-8.
Each file gets a key ``<root name>/<relative path>`` (e.g. ``stdlib/json/decoder.py``); the same
real path is kept once, and so is the same content (the first file in the visiting order below).

Split: a file is held out when ``sha256("heldout:" + key) % 10_000 < heldout_frac * 10_000``, so
the split depends only on the key (not on the machine's other files, the cap or the seed) and a
held-out file is never trained on. Size cap: files are taken in the order of ``sha256("order:" +
key)`` (a deterministic shuffle, so a cap samples all packages instead of the alphabetically first
ones), read lazily, until ``max_bytes`` of train text (and ``max_heldout_bytes`` of held-out text) are reached, at
most ``docs_frac`` of each being docs (.rst .txt .md; the rest .py: the models are for code).
The corpus depends on the machine (Python version, installed packages): ``Corpus.summary()`` is
recorded in train_report.json.
"""
from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

EXTENSIONS = (".py", ".rst", ".txt", ".md")
HELDOUT_FRAC = 0.02     # what the training runs use: a file key held out here is held out everywhere
ROOT_NAMES = ("stdlib", "purelib", "platlib")
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git"}


@dataclass(frozen=True)
class SourceFile:
    key: str          # "<root name>/<relative path>", the split and order key
    path: str         # absolute path
    text: str


@dataclass
class Corpus:
    train: list[SourceFile] = field(default_factory=list)       # in key order
    heldout: list[SourceFile] = field(default_factory=list)     # in key order
    roots: dict[str, str] = field(default_factory=dict)
    scanned_files: int = 0
    duplicates: int = 0

    def summary(self) -> dict:
        return {
            "roots": self.roots, "extensions": list(EXTENSIONS), "scanned_files": self.scanned_files,
            "duplicates_dropped": self.duplicates,
            "train_files": len(self.train), "train_bytes": sum(len(f.text.encode()) for f in self.train),
            "heldout_files": len(self.heldout),
            "heldout_bytes": sum(len(f.text.encode()) for f in self.heldout),
        }


def _unit(tag: str, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{tag}:{key}".encode()).digest()[:8], "big")


def is_heldout(key: str, heldout_frac: float) -> bool:
    """The split rule (module docstring): depends on the key only."""
    return _unit("heldout", key) % 10_000 < round(heldout_frac * 10_000)


def default_roots() -> dict[str, str]:
    """{root name: folder} from sysconfig, existing folders only, first name wins for a folder."""
    paths = sysconfig.get_paths()
    roots: dict[str, str] = {}
    for name in ROOT_NAMES:
        p = paths.get(name)
        if p and os.path.isdir(p) and os.path.realpath(p) not in {os.path.realpath(v) for v in roots.values()}:
            roots[name] = p
    return roots


def scan(roots: dict[str, str], max_file_bytes: int) -> list[tuple[str, str]]:
    """[(key, absolute path)] of every candidate file, sorted by key, each real path once (walked
    once per process for the same arguments: a package tree does not change under a run)."""
    return list(_scan(tuple(roots.items()), max_file_bytes))


@functools.lru_cache(maxsize=4)
def _scan(roots: tuple, max_file_bytes: int) -> tuple:
    roots = dict(roots)
    seen_real: set[str] = set()
    out = []
    for name, root in roots.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
            for fn in sorted(filenames):
                if not fn.endswith(EXTENSIONS):
                    continue
                path = os.path.join(dirpath, fn)
                try:
                    real = os.path.realpath(path)
                    if real in seen_real or not os.path.isfile(real) or os.path.getsize(real) > max_file_bytes:
                        continue
                except OSError:
                    continue
                seen_real.add(real)
                out.append((f"{name}/{os.path.relpath(path, root)}", path))
    out.sort()
    return tuple(out)


def build_corpus(*, max_bytes: int, max_heldout_bytes: int, heldout_frac: float = HELDOUT_FRAC,
                 docs_frac: float = 0.2, max_file_bytes: int = 200_000, roots: dict[str, str] | None = None) -> Corpus:
    """Collect, deduplicate, split and cap the corpus (module docstring)."""
    if not 0.0 < heldout_frac < 1.0:
        raise ValueError(f"heldout_frac must be in (0, 1), got {heldout_frac}")
    if not 0.0 <= docs_frac <= 1.0:
        raise ValueError(f"docs_frac must be in [0, 1], got {docs_frac}")
    if max_bytes <= 0 or max_heldout_bytes <= 0:
        raise ValueError(f"max_bytes and max_heldout_bytes must be > 0, got {max_bytes}, {max_heldout_bytes}")
    roots = default_roots() if roots is None else dict(roots)
    candidates = scan(roots, max_file_bytes)
    corpus = Corpus(roots=roots, scanned_files=len(candidates))
    # visit in the deterministic shuffle order, reading only until both budgets are full; a content
    # seen before (an earlier file in this order) is dropped
    seen_content: set[bytes] = set()
    budget = {}
    for held, total in ((True, max_heldout_bytes), (False, max_bytes)):
        budget[held, False] = int(total * docs_frac)          # .rst .txt .md
        budget[held, True] = total - budget[held, False]      # .py
    for key, path in sorted(candidates, key=lambda c: (_unit("order", c[0]), c[0])):
        if all(b <= 0 for b in budget.values()):
            break
        held = is_heldout(key, heldout_frac), key.endswith(".py")
        if budget[held] <= 0:
            continue
        try:
            raw = Path(path).read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip() or len(raw) > budget[held]:
            continue
        digest = hashlib.sha256(raw).digest()
        if digest in seen_content:
            corpus.duplicates += 1
            continue
        seen_content.add(digest)
        budget[held] -= len(raw)
        (corpus.heldout if held[0] else corpus.train).append(SourceFile(key, os.path.abspath(path), text))
    corpus.train.sort(key=lambda f: f.key)
    corpus.heldout.sort(key=lambda f: f.key)
    return corpus
