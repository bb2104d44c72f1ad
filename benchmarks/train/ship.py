"""Install a ``--preset default`` run as the embedded default model:

    python -m benchmarks.train.ship OUT_DIR      # OUT_DIR holds target/ and draft/ of that run

copies each folder's model files (config.json, generation_config.json, model.safetensors, the
tokenizer files and chat template) into ``hybrid_engine/data/default_target`` and
``data/default_draft`` (replacing what is there), after checking the layout the package relies on:
the target has its MTP step, both share one tokenizer, each file is < 15 MB and the two folders
together <= 25 MB. Commit the two folders afterwards.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from hybrid_engine.default_model import DEFAULT_DRAFT_DIR, DEFAULT_TARGET_DIR, REQUIRED_FILES

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja")
MAX_FILE, MAX_TOTAL = 15 * 10**6, 25 * 2**20


def check(run_dir: Path) -> None:
    for sub in ("target", "draft"):
        for name in REQUIRED_FILES:
            if not (run_dir / sub / name).is_file():
                raise ValueError(f"{run_dir / sub / name} is missing")
    sizes = {f"{sub}/{n}": (run_dir / sub / n).stat().st_size for sub in ("target", "draft") for n in FILES
             if (run_dir / sub / n).is_file()}
    big = {k: v for k, v in sizes.items() if v >= MAX_FILE}
    if big or sum(sizes.values()) > MAX_TOTAL:
        raise ValueError(f"files too large for the package (each < {MAX_FILE}, all <= {MAX_TOTAL}): {sizes}")
    if (run_dir / "target/tokenizer.json").read_bytes() != (run_dir / "draft/tokenizer.json").read_bytes():
        raise ValueError("target and draft tokenizers differ")
    cfg = json.loads((run_dir / "target/config.json").read_text())
    if cfg.get("num_nextn_predict_layers", 0) < 1:
        raise ValueError("the target has no MTP step (num_nextn_predict_layers)")


def ship(run_dir) -> None:
    run_dir = Path(run_dir)
    check(run_dir)
    for sub, dest in (("target", DEFAULT_TARGET_DIR), ("draft", DEFAULT_DRAFT_DIR)):
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        for name in FILES:
            src = run_dir / sub / name
            if src.is_file():
                shutil.copyfile(src, dest / name)
                (dest / name).chmod(0o644)
        print(f"{sub}: {sorted(p.name for p in dest.iterdir())} -> {dest}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    ship(sys.argv[1])
