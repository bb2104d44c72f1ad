"""Write a quantized copy of a 16/32-bit Nemotron-H folder in NVIDIA ModelOpt's published layout.

    python -m hybrid_engine.quantize SRC DST [--format fp8|nvfp4] [--exclude PATTERN ...]
                                     [--calibrate N] [--device cpu|cuda] [--kv-cache-fp8]

Every linear layer's weight (Mamba in/out projections, attention q/k/v/o, MLP and shared-expert
up/down, latent projections, MTP eh_proj), except the excluded ones (default: ``lm_head``) and a
weight tied to the embeddings, is written as
- fp8: ``<layer>.weight`` float8_e4m3fn [N, K], ``<layer>.weight_scale`` float32 [] (per tensor,
  amax / 448) and ``<layer>.input_scale`` float32 [];
- nvfp4: ``<layer>.weight`` uint8 [N, K/2] (two e2m1 codes per byte, low nibble first),
  ``<layer>.weight_scale`` float8_e4m3fn [N, K/16], ``<layer>.weight_scale_2`` float32 [] and
  ``<layer>.input_scale`` float32 [];
every other tensor is copied as stored, under its stored name. config.json gains
``quantization_config`` (``QuantConfig.to_published``) and ``hf_quant_config.json`` is written
beside it; tokenizer and generation files are copied.

``input_scale`` is amax / 448 of the layer's inputs over a calibration run (``--calibrate N``: N
built-in prompts through this engine, enforce_eager, greedy, 16 tokens each); a layer the run never
reached (e.g. the MTP layers) gets no input_scale, which the engine reads as "dynamic". With
``--calibrate 0`` no input_scale is written. Routed experts are left in 16 bits and listed in
``exclude_modules``, unless ``--experts``: then each expert is written per expert
(``<p>.experts.<e>.up_proj.weight`` ...) like the other layers, without input_scale (the engine runs
FP8 and NVFP4 experts in the fused MoE as stored).

``--kv-cache-fp8`` (needs calibration) also writes the FP8 KV-cache scales ModelOpt exports: per
backbone attention layer ``<attn>.k_proj.k_scale`` and ``<attn>.v_proj.v_scale``, float32 [] =
amax / 448 of the k_proj / v_proj outputs over the calibration run, and sets
``kv_cache_quant_algo: "FP8"``; the engine uses them with ``kv_cache_dtype="fp8"``.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .quantization.config import HF_QUANT_FILE, QuantConfig
from .quantization.fp8 import FP8_MAX, quantize_fp8
from .quantization.nvfp4 import quantize_nvfp4

logger = logging.getLogger(__name__)
_COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
           "generation_config.json", "chat_template.jinja")
CALIBRATION_PROMPTS = (
    "The quick brown fox jumps over the lazy dog.",
    "In 1905 Albert Einstein published four papers that changed physics:",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Translate to French: The weather is nice today.",
    "List three uses of a hybrid Mamba-attention model.",
    "Q: What is the capital of Australia?\nA:",
    "Once upon a time, in a village by the sea,",
    "The derivative of sin(x) * exp(x) is",
)


def _linear_names(src: Path, cfg) -> tuple[list[str], set[str], list[str]]:
    """(linear layer names in model naming, names whose weight is tied to the embeddings,
    merged expert module names)."""
    from .models.moe import Experts
    from .models.nemotron_h import NemotronHForCausalLM
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg, with_mtp=cfg.num_nextn_predict_layers > 0)
    emb = model.backbone.embeddings.weight
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    tied = {n for n in linears if model.get_submodule(n).weight is emb}
    experts = [n for n, m in model.named_modules() if isinstance(m, Experts)]
    return linears, tied, experts


def calibrate(src: Path, num_prompts: int, device: str) -> dict[str, float]:
    """{linear layer name: amax of its inputs, and "<layer>:out": amax of its outputs for the
    attention k_proj / v_proj layers} over ``num_prompts`` calibration prompts."""
    from . import LLM, SamplingParams
    llm = LLM(str(src), device=device, enforce_eager=True, async_scheduling=False)
    amax: dict[str, torch.Tensor] = {}
    hooks = []

    def track(key: str, t: torch.Tensor) -> None:
        a = t.detach().abs().amax().float()
        amax[key] = torch.maximum(amax[key], a) if key in amax else a
    for name, mod in llm.engine.model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            hooks.append(mod.register_forward_pre_hook(lambda _m, args, name=name: track(name, args[0])))
            if name.endswith((".k_proj", ".v_proj")):       # what an FP8 KV cache stores
                hooks.append(mod.register_forward_hook(lambda _m, _a, out, name=name: track(name + ":out", out)))
    prompts = [CALIBRATION_PROMPTS[i % len(CALIBRATION_PROMPTS)] for i in range(num_prompts)]
    if llm.tokenizer is None:
        g = torch.Generator().manual_seed(0)
        vocab = llm.engine.cfg.model.vocab_size
        prompts = [torch.randint(3, vocab, (24,), generator=g).tolist() for _ in prompts]
    llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    for h in hooks:
        h.remove()
    return {k: float(v) for k, v in amax.items()}


_PER_EXPERT = re.compile(r"^.*\.experts\.\d+\.(up_proj|down_proj)\.weight$")


def _quantize_into(out: dict, base: str, w: torch.Tensor, method: str, amax: float | None) -> None:
    """out[base.weight, base.weight_scale(, _2), base.input_scale] = the quantized layer."""
    if method == "fp8":
        out[base + ".weight"], out[base + ".weight_scale"] = quantize_fp8(w, per_channel=False)
    else:
        out[base + ".weight"], out[base + ".weight_scale"], out[base + ".weight_scale_2"] = quantize_nvfp4(w)
    if amax is not None:
        out[base + ".input_scale"] = torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float32)


def _kv_scales(cfg, amax: dict[str, float], disk_name: dict[str, str]) -> dict[str, torch.Tensor]:
    """{disk name: scale} of the FP8 KV-cache scales of every backbone attention layer."""
    from .models.nemotron_h import NemotronHForCausalLM
    from .quantization.kv_scales import attention_module_names
    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg)
    out = {}
    for attn in attention_module_names(model):
        for proj, suffix in (("k_proj", "k_scale"), ("v_proj", "v_scale")):
            a = amax.get(f"{attn}.{proj}:out")
            if a is None:
                raise ValueError(f"calibration never reached {attn}.{proj}: no KV-cache scale for it")
            # named like the layer's weight on disk (the checkpoint's own backbone prefix)
            base = disk_name[f"{attn}.{proj}.weight"][: -len("weight")]
            out[base + suffix] = torch.tensor(a / FP8_MAX if a > 0 else 1.0, dtype=torch.float32)
    return out


def quantize_folder(src, dst, method: str = "fp8", exclude: tuple[str, ...] = ("lm_head",),
                    calibrate_prompts: int = 8, device: str = "cpu", experts: bool = False,
                    kv_cache: bool = False) -> QuantConfig:
    """Write the quantized copy of ``src`` to ``dst`` (module docstring); returns its QuantConfig.
    ``kv_cache``: also write FP8 KV-cache scales (``--kv-cache-fp8``)."""
    from ._config_parse import read_config_json
    from .config import ModelConfig
    from .models.checkpoint_files import canonical_names, open_safetensors, weight_files
    src, dst = Path(src), Path(dst)
    cfg = ModelConfig.from_json(src)
    if cfg.quantization is not None:
        raise ValueError(f"{src} is already quantized ({cfg.quantization.method}); give a 16/32-bit folder")
    if kv_cache and calibrate_prompts < 1:
        raise ValueError("kv_cache=True (--kv-cache-fp8) needs calibration prompts (calibrate_prompts >= 1)")
    linears, tied, _experts = _linear_names(src, cfg)
    probe = QuantConfig(method=method, source="checkpoint", exclude_modules=tuple(exclude))
    chosen = {n for n in linears if n not in tied and not probe.excluded(n)}
    expert_mods = _experts
    exclude_all = tuple(exclude) + tuple(sorted(tied)) + (() if experts else tuple(f"{e}*" for e in expert_mods))
    q = QuantConfig(method=method, source="checkpoint", exclude_modules=exclude_all,
                    kv_cache_quant_algo="FP8" if kv_cache else None)
    amax = calibrate(src, calibrate_prompts, device) if calibrate_prompts > 0 else {}
    files = weight_files(src)
    with torch.device("meta"):
        from .models.nemotron_h import NemotronHForCausalLM
        names = NemotronHForCausalLM(cfg, with_mtp=cfg.num_nextn_predict_layers > 0).state_dict().keys()
    renamed = canonical_names(files, names)
    out: dict[str, torch.Tensor] = {}
    n_quant = 0
    for disk, path in sorted(files.items()):
        with open_safetensors(path) as f:
            t = f.get_tensor(disk)
        mod, _, suffix = renamed[disk].rpartition(".")
        if experts and mod in expert_mods and suffix in ("up_proj", "down_proj"):
            # merged [E, out, in] -> the published per-expert layout
            for e in range(t.shape[0]):
                _quantize_into(out, f"{disk[: -len(suffix) - 1]}.{e}.{suffix}", t[e], method, None)
                n_quant += 1
            continue
        is_expert = experts and _PER_EXPERT.match(renamed[disk]) is not None
        if suffix != "weight" or (mod not in chosen and not is_expert):
            out[disk] = t.contiguous()
            continue
        _quantize_into(out, disk[: -len(".weight")], t, method, amax.get(mod))
        n_quant += 1
    if kv_cache:
        out.update(_kv_scales(cfg, amax, {m: d for d, m in renamed.items()}))
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    d = read_config_json(src)
    d["quantization_config"] = q.to_published()
    (dst / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    hq = {"producer": {"name": "modelopt", "version": "hybrid_engine.quantize"},
          "quantization": {k: v for k, v in q.to_published().items() if k != "quant_method"}}
    (dst / HF_QUANT_FILE).write_text(json.dumps(hq, indent=2) + "\n")
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    logger.info("wrote %s: %d linear layers in %s, %d tensors in all", dst, n_quant, method, len(out))
    return q


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybrid_engine.quantize", description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="16/32-bit model folder")
    ap.add_argument("dst", help="output folder")
    ap.add_argument("--format", choices=("fp8", "nvfp4"), default="fp8")
    ap.add_argument("--exclude", nargs="*", default=["lm_head"],
                    help="module names / fnmatch patterns left in 16 bits (default: lm_head)")
    ap.add_argument("--calibrate", type=int, default=8, metavar="N",
                    help="calibration prompts for input_scale (0: write no input_scale)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--experts", action="store_true",
                    help="also quantize the routed experts (per-expert tensors; the engine runs FP8 "
                         "and NVFP4 experts in the fused MoE as stored)")
    ap.add_argument("--kv-cache-fp8", action="store_true",
                    help="also write FP8 KV-cache scales (k_scale / v_scale per attention layer, from the "
                         "calibration run) for kv_cache_dtype='fp8'")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    quantize_folder(args.src, args.dst, args.format, tuple(args.exclude), args.calibrate, args.device,
                    experts=args.experts, kv_cache=args.kv_cache_fp8)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
