"""Which layers a checkpoint stores quantized, read from the safetensors headers only."""
from __future__ import annotations

from .config import QuantConfig

SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale")
QUANTIZED_CODES = ("F8_E4M3", "F8_E5M2", "U8", "I8", "I4", "U4")


def stored_quantized(model_dir, model, q: QuantConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """{module name (model naming): {"weight" | scale suffix: stored shape}} for every module whose
    ``weight`` is stored in a quantized dtype. ValueError when a weight's dtype is not the one
    ``q.method`` stores (e.g. uint8 in an FP8 checkpoint)."""
    from ..models.checkpoint_files import canonical_names, open_safetensors, weight_files
    from .linear import STORED_WEIGHT_DTYPE
    files = weight_files(model_dir)
    renamed = canonical_names(files, model.state_dict(keep_vars=True))
    want = STORED_WEIGHT_DTYPE[q.method]
    by_file: dict = {}
    for disk, path in files.items():
        by_file.setdefault(path, []).append(disk)
    tensors: dict[str, dict[str, tuple]] = {}
    quantized: set[str] = set()
    for path, names in by_file.items():
        with open_safetensors(path) as f:
            for disk in names:
                mod, _, suffix = renamed[disk].rpartition(".")
                if suffix not in ("weight",) + SCALE_SUFFIXES:
                    continue
                sl = f.get_slice(disk)
                tensors.setdefault(mod, {})[suffix] = tuple(sl.get_shape())
                if suffix == "weight" and sl.get_dtype() in QUANTIZED_CODES:
                    if sl.get_dtype() != want:
                        raise ValueError(f"checkpoint {model_dir}: {disk} is stored as {sl.get_dtype()}, but "
                                         f"config.json says {q.method} (whose weights are {want})")
                    quantized.add(mod)
    # a model built without its MTP layers skips the checkpoint's mtp.* tensors (loader rule)
    has_mtp = any(n.startswith("mtp.") for n, _ in model.named_modules())
    return {m: tensors[m] for m in sorted(quantized) if has_mtp or not m.startswith("mtp.")}
