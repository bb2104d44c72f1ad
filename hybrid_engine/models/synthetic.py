"""Synthetic Nemotron-H checkpoints: the embedded default model, tests and benchmarks build their
models here (the transformers references the tests compare against live in tests/hf_reference.py).

``make_hf_model`` builds a transformers ``NemotronHForCausalLM``, re-initialises it with O(1)-scale
weights (``scale="sens"``, see ``sens_init_``; std-0.02 weights hide state bugs) and saves it with
``save_pretrained``. ``hf_greedy`` / ``hf_logits`` run transformers on such a folder in float32.

dt clamp: transformers clamps dt to ``config.time_step_min`` on its multi-token (chunked) path
only, while the engine applies ``time_step_limit`` everywhere. The models written here set
``time_step_min=1e-7`` so the transformers clamp never bites (dt = softplus(x + dt_bias) stays far
above it; ``hf_dt_values`` lets a test check that). docs/checkpoints.md explains the two
semantics and how the published-config tests keep the real ``time_step_min``.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
from pathlib import Path

import torch

KIND_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
TINY_TIME_STEP_MIN = 1e-7
LM_HEAD_GAIN = 2.0          # logit std ~= LM_HEAD_GAIN on the sens init
DT_RANGE = (1e-3, 1e-1)     # softplus(dt_bias) log-uniform in this range
A_RANGE = (1.0, 16.0)       # -A = exp(A_log) uniform in this range


def _pattern_list(pattern: str, field: str) -> list[str]:
    bad = [c for c in pattern if c not in KIND_NAMES]
    if bad or not pattern:
        raise ValueError(f"{field} must be a non-empty string over 'M', '*', '-', 'E', got {pattern!r}")
    return [KIND_NAMES[c] for c in pattern]


# ----------------------------------------------------------------------------------------- init

@torch.no_grad()
def sens_init_(module: torch.nn.Module, seed: int = 0, *, lm_head_gain: float = LM_HEAD_GAIN,
               tied_embeddings: bool = False) -> torch.nn.Module:
    """Re-initialise every parameter/buffer of a Nemotron-H module (transformers naming, or
    on-disk naming) with O(1)-scale values, deterministically from ``seed`` (one CPU generator,
    tensors visited in sorted name order):

    - embeddings N(0, 1) (tied embeddings: N(0, lm_head_gain^2 / D), they are also the lm_head);
    - matrices (Linear weights, eh_proj, router gate, merged experts [E, out, in]) N(0, 1/fan_in),
      lm_head N(0, lm_head_gain^2 / D), so logits have std ~ lm_head_gain;
    - RMSNorm weights (block norm, norm_f, gated mixer norm, MTP enorm/hnorm/final_layernorm)
      U(0.8, 1.2); biases (conv1d and optional Linear biases) N(0, 0.1^2);
    - conv1d weight N(0, 1/W) (W = kernel width); A_log = log U(1, 16); D ~ N(0, 1);
    - dt_bias = softplus^-1(dt0), dt0 log-uniform in [1e-3, 1e-1];
    - e_score_correction_bias N(0, 0.05^2) (float32).
    """
    g = torch.Generator().manual_seed(seed)
    tensors = dict(module.named_parameters())
    tensors.update({n: b for n, b in module.named_buffers() if n.endswith("e_score_correction_bias")})

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    def rand(shape):
        return torch.rand(shape, generator=g, dtype=torch.float32)

    for name in sorted(tensors):
        t = tensors[name]
        leaf = name.rsplit(".", 1)[-1]
        shape = t.shape
        if name.endswith("embeddings.weight") or name.endswith("embed_tokens.weight"):
            d = shape[-1]
            v = randn(shape) * (lm_head_gain / math.sqrt(d) if tied_embeddings else 1.0)
        elif name.endswith("lm_head.weight"):
            v = randn(shape) * (lm_head_gain / math.sqrt(shape[-1]))
        elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            v = 0.8 + 0.4 * rand(shape)
        elif name.endswith("conv1d.weight"):
            v = randn(shape) / math.sqrt(shape[-1])
        elif leaf == "A_log":
            v = torch.log(A_RANGE[0] + (A_RANGE[1] - A_RANGE[0]) * rand(shape))
        elif leaf == "D":
            v = randn(shape)
        elif leaf == "dt_bias":
            lo, hi = math.log(DT_RANGE[0]), math.log(DT_RANGE[1])
            dt = torch.exp(lo + (hi - lo) * rand(shape))
            v = dt + torch.log(-torch.expm1(-dt))          # softplus^-1
        elif leaf == "e_score_correction_bias":
            v = 0.05 * randn(shape)
        elif leaf == "bias":
            v = 0.1 * randn(shape)
        elif t.dim() >= 2:
            v = randn(shape) / math.sqrt(shape[-1])
        else:
            raise ValueError(f"sens_init_: no init rule for tensor {name} {list(shape)}")
        t.copy_(v)
    return module


# ------------------------------------------------------------------------------------ MTP tensors

def split_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' merged ``...experts.up_proj`` [E, F, D] -> on-disk ``...experts.{e}.up_proj.weight``."""
    out = {}
    for k, v in sd.items():
        head, _, leaf = k.rpartition(".")
        if head.endswith("experts") and leaf in ("up_proj", "down_proj") and v.dim() == 3:
            for e in range(v.shape[0]):
                out[f"{head}.{e}.{leaf}.weight"] = v[e].clone()
        else:
            out[k] = v
    return out


def make_mtp_tensors(config, seed: int = 0) -> dict[str, torch.Tensor]:
    """O(1)-scale MTP weights in the published on-disk layout, float32.

    For each of ``num_nextn_predict_layers`` steps s and each symbol j of the MTP pattern
    (``config.mtp_layers_block_type``, default "*E"), sub-layer index i = s * len(pattern) + j:
      i first of its step:  mtp.layers.{i}.enorm.weight [D], .hnorm.weight [D], .eh_proj.weight [D, 2D]
                            (h = eh_proj(cat(enorm(embed(token)), hnorm(previous hidden))))
      every sub-layer:      mtp.layers.{i}.norm.weight [D] and mtp.layers.{i}.mixer.* named like a
                            backbone block of that kind (attention q/k/v/o_proj, MoE gate.weight,
                            gate.e_score_correction_bias, experts.{e}.up_proj/down_proj.weight,
                            shared_experts.*; MLP up/down_proj; Mamba in_proj, conv1d, ...)
      i last of its step:   mtp.layers.{i}.final_layernorm.weight [D]
    Embeddings and lm_head are shared with the main model. (Published checkpoints have one step;
    the index continuation for more steps is this project's convention.)
    """
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

    kinds = list(config.mtp_layers_block_type)
    d = config.hidden_size
    sub_cfg = copy.deepcopy(config)
    sub_cfg.layers_block_type = kinds
    out: dict[str, torch.Tensor] = {}
    for s in range(config.num_nextn_predict_layers):
        for j in range(len(kinds)):
            i = s * len(kinds) + j
            block = NemotronHBlock(sub_cfg, j).float()
            if j == 0:
                block.enorm = torch.nn.Module()
                block.enorm.weight = torch.nn.Parameter(torch.ones(d))
                block.hnorm = torch.nn.Module()
                block.hnorm.weight = torch.nn.Parameter(torch.ones(d))
                block.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
            if j == len(kinds) - 1:
                block.final_layernorm = torch.nn.Module()
                block.final_layernorm.weight = torch.nn.Parameter(torch.ones(d))
            sens_init_(block, seed=seed * 1000 + 7919 + i)
            for k, v in split_experts(block.state_dict()).items():
                out[f"mtp.layers.{i}.{k}"] = v.detach().clone().contiguous()
    return out


def _add_tensors(out_dir: Path, extra: dict[str, torch.Tensor]) -> None:
    """Add tensors to a saved checkpoint (rewrites model.safetensors, or adds a shard)."""
    from safetensors.torch import load_file, save_file

    index = out_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        save_file(extra, str(out_dir / "model-mtp.safetensors"), metadata={"format": "pt"})
        data["weight_map"].update({k: "model-mtp.safetensors" for k in extra})
        index.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    path = out_dir / "model.safetensors"
    sd = load_file(str(path))
    sd.update(extra)
    save_file(sd, str(path), metadata={"format": "pt"})


# -------------------------------------------------------------------------------- model builder

def hf_config(pattern: str = "M-M*-M*-", **kwargs):
    """A transformers NemotronHConfig with ``layers_block_type`` from a pattern string."""
    from transformers import NemotronHConfig

    mtp = kwargs.pop("mtp_pattern", None)
    if mtp is not None:
        kwargs["mtp_layers_block_type"] = _pattern_list(mtp, "mtp_pattern")
    return NemotronHConfig(layers_block_type=_pattern_list(pattern, "pattern"), **kwargs)


def make_hf_model(out_dir, pattern: str = "M-M*-M*-", *, vocab_size: int = 256, hidden_size: int = 64,
                  num_attention_heads: int = 4, num_key_value_heads: int = 2, head_dim: int = 16,
                  intermediate_size: int = 128, mamba_num_heads: int = 8, mamba_head_dim: int = 16,
                  n_groups: int = 2, ssm_state_size: int = 16, conv_kernel: int = 4, chunk_size: int = 16,
                  n_routed_experts: int = 4, num_experts_per_tok: int = 2, moe_intermediate_size: int = 64,
                  moe_shared_expert_intermediate_size: int = 64, n_group: int = 1, topk_group: int = 1,
                  num_nextn_predict_layers: int = 0, tie_word_embeddings: bool = False, seed: int = 0,
                  scale: str = "sens", with_tokenizer: bool = False, dtype: torch.dtype = torch.float32,
                  **overrides) -> Path:
    """Write a tiny Nemotron-H checkpoint with transformers' ``save_pretrained``; returns the folder.

    ``pattern``: one symbol per block (M Mamba2, * attention, - MLP, E MoE).
    ``scale``: "sens" (``sens_init_``: O(1)-scale, catches state bugs) or "hf" (transformers'
    default std-0.02 init). ``time_step_min`` defaults to 1e-7 (see the module docstring); any
    other NemotronHConfig field can be given in ``overrides`` (``mtp_pattern="*E"`` sets the MTP
    pattern). ``num_nextn_predict_layers > 0`` also writes ``mtp.*`` tensors (layout in
    ``make_mtp_tensors``), which transformers ignores. ``tie_word_embeddings=True`` writes
    lm_head.weight as a copy of the embeddings (transformers' NemotronH never ties; drop the
    tensor from the file to test a loader's tying). ``with_tokenizer`` saves the project's
    byte-level BPE tokenizer (needs vocab_size >= 259). ``dtype`` is the stored dtype
    (e_score_correction_bias stays float32).
    """
    from transformers import NemotronHForCausalLM

    if scale not in ("sens", "hf"):
        raise ValueError(f"scale must be 'sens' or 'hf', got {scale!r}")
    if with_tokenizer and vocab_size < 259:
        raise ValueError(f"with_tokenizer=True needs vocab_size >= 259 (256 byte tokens + 3 special "
                         f"tokens), got {vocab_size}")
    out_dir = Path(out_dir)
    overrides.setdefault("time_step_min", TINY_TIME_STEP_MIN)
    config = hf_config(
        pattern, vocab_size=vocab_size, hidden_size=hidden_size, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        mamba_num_heads=mamba_num_heads, mamba_head_dim=mamba_head_dim, n_groups=n_groups,
        ssm_state_size=ssm_state_size, conv_kernel=conv_kernel, chunk_size=chunk_size,
        n_routed_experts=n_routed_experts, num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size,
        moe_shared_expert_intermediate_size=moe_shared_expert_intermediate_size, n_group=n_group,
        topk_group=topk_group, num_nextn_predict_layers=num_nextn_predict_layers,
        tie_word_embeddings=tie_word_embeddings, **overrides)
    torch.manual_seed(seed)      # transformers' own init (scale="hf") draws from the global RNG
    model = NemotronHForCausalLM(config).float().eval()
    if scale == "sens":
        sens_init_(model, seed, tied_embeddings=tie_word_embeddings)
    if tie_word_embeddings:
        # transformers' NemotronH does not tie (``_tied_weights_keys = {}``): it reads lm_head.weight
        # from the file. Store a copy of the embeddings there so it computes the tied model.
        with torch.no_grad():
            model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    if dtype != torch.float32:
        model.to(dtype)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.data = mod.e_score_correction_bias.data.float()
    out_dir.mkdir(parents=True, exist_ok=True)
    with _quiet_transformers():
        model.save_pretrained(out_dir)
    if num_nextn_predict_layers > 0:
        extra = make_mtp_tensors(config, seed)
        extra = {k: (v if k.endswith("e_score_correction_bias") else v.to(dtype)) for k, v in extra.items()}
        _add_tensors(out_dir, extra)
    if with_tokenizer:
        from ..default_model import save_tokenizer
        save_tokenizer(out_dir, vocab_size)
    return out_dir


# ------------------------------------------------------------------------ the other families

def make_family_model(out_dir, model_type: str, *, seed: int = 0, with_tokenizer: bool = False,
                      **config) -> Path:
    """Write a tiny checkpoint of another Mamba2 hybrid family (``model_type``: "bamba",
    "granitemoehybrid", "falcon_h1") with transformers' own config and model classes and
    ``save_pretrained``, re-initialised with ``sens_init_`` (O(1)-scale weights); ``config`` is
    passed to the family's transformers config class as is. Returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    vocab = config.get("vocab_size", 0)
    if with_tokenizer and vocab < 259:
        raise ValueError(f"with_tokenizer=True needs vocab_size >= 259, got {vocab}")
    hf_cfg = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    with _quiet_transformers():
        model = AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    sens_init_(model, seed, tied_embeddings=bool(hf_cfg.tie_word_embeddings))
    out_dir.mkdir(parents=True, exist_ok=True)
    with _quiet_transformers():
        model.save_pretrained(out_dir)
    if with_tokenizer:
        from ..default_model import save_tokenizer
        save_tokenizer(out_dir, vocab)
    return out_dir


# ---------------------------------------------------------------------------- transformers refs

@contextlib.contextmanager
def _quiet_transformers():
    """No progress bars and no kernel-fallback warnings from transformers inside the block."""
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
