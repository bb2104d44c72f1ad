"""Presets, the trained modules and how they are saved.

The target is transformers' ``NemotronHForCausalLM`` (Mamba2, attention, MLP and MoE blocks; on a
machine without mamba-ssm its PyTorch reference path runs forward and backward, on CPU and CUDA)
plus ``MTPHead``, one multi-token-prediction step built from transformers' ``NemotronHBlock``
sub-layers and saved in the published ``mtp.layers.*`` layout that ``hybrid_engine/models/mtp.py``
loads. The MTP math (the engine's, see that module):

    pair i (target hidden h_i after norm_f, token t_{i+1}) predicts t_{i+2}:
    x = eh_proj(cat(enorm(embed(t_{i+1})), hnorm(h_i)))
    for each sub-layer: x = x + mixer(norm(x))     (attention: causal over pairs 0..i, no RoPE)
    logits = lm_head(final_layernorm(x))           (embeddings and lm_head shared with the target)

dt clamp: the saved configs set ``time_step_limit = [time_step_min, inf]``: transformers clamps dt
to ``time_step_min`` on its chunked (training and prefill) path, and the engine applies
``time_step_limit`` everywhere, so both compute the trained function.
"""
from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F

MTP_PATTERN = "*E"


@dataclass(frozen=True)
class Preset:
    name: str
    vocab_size: int
    target: dict                  # make_hf_model-style shape: pattern + NemotronHConfig fields
    draft: dict
    seq_len: int                  # tokens per training window (the window holds seq_len + 1)
    batch_size: int
    lr: float
    draft_lr: float
    max_steps: int
    time_budget_s: float          # wall-time limit of the training loop
    corpus_bytes: int
    heldout_bytes: int
    eval_windows: int             # held-out windows of seq_len + 1 tokens scored after training
    tokenizer_bytes: int = 8_000_000   # BPE trained on the first this many bytes of train text
    mtp_weight: float = 0.5       # loss = next-token + mtp_weight * next-next-token
    warmup_steps: int = 50
    save_dtype: str = "float32"   # stored tensor dtype
    bf16_autocast: bool = False   # CUDA training under bf16 autocast (weights and optimizer state stay float32)
    config_dtype: str = "float32"  # config.json "dtype" (what `dtype="auto"` runs in)
    # share of each batch's windows that repeat a piece of text (train.copy_windows), to teach
    # copying from the context, which speculation lives on. bench-large takes 0.5: at 420 s of
    # training it copies (0.40 nats a copied token against 1.57 without copy windows) and its
    # held-out loss is lower too (2.243 against 2.318); at 240 s it had not learned to copy yet
    # (2.08). benchmarks/results/2026-11-27-train-copy-windows-420s-h100.md
    copy_frac: float = 0.0
    extra: dict = field(default_factory=dict)


_MOE = dict(n_group=1, topk_group=1)

# the GPU benchmarks' draft model (~9M params), the same for "bench" and "bench-large"
_BENCH_DRAFT = dict(pattern="M*-", hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    intermediate_size=768, mamba_num_heads=8, mamba_head_dim=32, n_groups=2, ssm_state_size=32,
                    conv_kernel=4, chunk_size=128)

PRESETS = {
    # tests: a few steps on CPU in seconds (init std 0.1, not 0.02: logits spread enough for the
    # transformers-vs-engine comparisons to mean something after 4 steps)
    "tiny": Preset(
        "tiny", vocab_size=384,
        target=dict(pattern="M-*E", hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                    intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                    conv_kernel=4, chunk_size=16, n_routed_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, initializer_range=0.1,
                    **_MOE),
        draft=dict(pattern="M*", hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                   intermediate_size=64, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                   conv_kernel=4, chunk_size=16, initializer_range=0.1),
        seq_len=32, batch_size=4, lr=3e-3, draft_lr=3e-3, max_steps=4, time_budget_s=60.0,
        corpus_bytes=80_000, heldout_bytes=10_000, eval_windows=2, warmup_steps=1),
    # the shipped embedded default (hybrid_engine/data/): ~6.5M target incl. MTP, ~1.2M draft, bf16 files
    "default": Preset(
        "default", vocab_size=4096,
        target=dict(pattern="M-M*-M-ME", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=64, intermediate_size=768, mamba_num_heads=8, mamba_head_dim=32, n_groups=2,
                    ssm_state_size=32, conv_kernel=4, chunk_size=64, n_routed_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=256, moe_shared_expert_intermediate_size=256, **_MOE),
        draft=dict(pattern="M*-", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                   intermediate_size=384, mamba_num_heads=4, mamba_head_dim=32, n_groups=1, ssm_state_size=32,
                   conv_kernel=4, chunk_size=64),
        seq_len=256, batch_size=32, lr=2e-3, draft_lr=3e-3, max_steps=100_000, time_budget_s=150.0,
        corpus_bytes=16_000_000, heldout_bytes=1_000_000, eval_windows=32, warmup_steps=100,
        save_dtype="bfloat16", config_dtype="float32",
        # the shipped model: 150 s with half the windows copies (H100, 194 s in all) scored lower
        # held-out losses than 100 s without (target 2.715 / MTP 2.805 / draft 3.255 against
        # 2.792 / 2.898 / 3.465) and copies a restarted block (examples/spec_decode.py n-gram
        # acceptance 3.67 against 1.73); benchmarks/results/2026-11-27-train-default-copy-h100.md
        copy_frac=0.5),
    # the GPU benchmark's target (~90M params incl. MTP), trained in the benchmark's device call
    "bench": Preset(
        "bench", vocab_size=16384,
        target=dict(pattern="M-M*-M-M*-ME", hidden_size=768, num_attention_heads=12, num_key_value_heads=4,
                    head_dim=64, intermediate_size=3072, mamba_num_heads=24, mamba_head_dim=64, n_groups=2,
                    ssm_state_size=64, conv_kernel=4, chunk_size=128, n_routed_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=768, moe_shared_expert_intermediate_size=768, **_MOE),
        draft=_BENCH_DRAFT,
        seq_len=512, batch_size=32, lr=1e-3, draft_lr=2e-3, max_steps=100_000, time_budget_s=210.0,
        corpus_bytes=32_000_000, heldout_bytes=2_000_000, eval_windows=32, warmup_steps=100,
        save_dtype="bfloat16", config_dtype="bfloat16"),
    # a target large enough that a batch-1 decode step on an H100 reads more bytes than its kernels
    # wait on launches (175.5M params, 18 blocks, hidden 1024; + 23.6M MTP step, 9.2M draft),
    # trained under bf16 autocast on the GPU that then runs the spec benchmark (in the next call on
    # the warm machine): 420 s of training with half the windows copy windows, ~26.5 M tokens, a
    # whole run ~8.5 minutes on an H100 with --eval-windows 4 (the default 16 scores longer)
    "bench-large": Preset(
        "bench-large", vocab_size=16384,
        target=dict(pattern="M-M-M*-M-M-M*-M-ME", hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
                    head_dim=64, intermediate_size=4096, mamba_num_heads=32, mamba_head_dim=64, n_groups=4,
                    ssm_state_size=128, conv_kernel=4, chunk_size=128, n_routed_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=1024, moe_shared_expert_intermediate_size=1024, **_MOE),
        draft=_BENCH_DRAFT,
        seq_len=512, batch_size=32, lr=1e-3, draft_lr=2e-3, max_steps=100_000, time_budget_s=420.0,
        corpus_bytes=32_000_000, heldout_bytes=2_000_000, eval_windows=16, warmup_steps=100,
        save_dtype="float32", config_dtype="float32", bf16_autocast=True, copy_frac=0.5),
}


def preset(name: str, **overrides) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def hf_config_for(shape: dict, vocab_size: int, *, mtp: bool):
    """transformers NemotronHConfig of a preset shape (dt init range and clamp: module docstring)."""
    from hybrid_engine.models.synthetic import hf_config

    kw = dict(shape)
    pattern = kw.pop("pattern")
    if mtp:
        kw.update(num_nextn_predict_layers=1, mtp_pattern=MTP_PATTERN)
    cfg = hf_config(pattern, vocab_size=vocab_size, tie_word_embeddings=False, **kw)
    cfg.time_step_limit = (cfg.time_step_min, math.inf)
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 0, 1, 2
    return cfg


# ------------------------------------------------------------------------------------- MTP head

def _norm(d: int, eps: float) -> nn.Module:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm
    return NemotronHRMSNorm(d, eps=eps)


class MTPHead(nn.Module):
    """One MTP step (module docstring); parameter names are the on-disk ``mtp.*`` names minus the
    ``mtp.`` prefix (merged experts are split at save time)."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHBlock

        kinds = list(config.mtp_layers_block_type)
        sub_cfg = copy.deepcopy(config)
        sub_cfg.layers_block_type = kinds
        d, eps = config.hidden_size, config.layer_norm_epsilon
        layers = []
        for j, kind in enumerate(kinds):
            if kind not in ("full_attention", "moe", "mlp"):
                raise ValueError(f"MTP sub-layer kind {kind!r} is not supported; allowed: attention, moe, mlp")
            block = NemotronHBlock(sub_cfg, j)
            if j == 0:
                block.enorm, block.hnorm = _norm(d, eps), _norm(d, eps)
                block.eh_proj = nn.Linear(2 * d, d, bias=False)
            if j == len(kinds) - 1:
                block.final_layernorm = _norm(d, eps)
            layers.append(block)
        self.layers = nn.ModuleList(layers)
        self.kinds = kinds

    def forward(self, embeds: torch.Tensor, prev_hidden: torch.Tensor) -> torch.Tensor:
        """embeds = embed(t_{i+1}), prev_hidden = h_i, both [B, T, D] -> final-normed [B, T, D]."""
        first = self.layers[0]
        h = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(prev_hidden)], -1))
        for layer, kind in zip(self.layers, self.kinds):
            x = layer.norm(h)
            if kind == "full_attention":
                h = h + _causal_attention(layer.mixer, x)
            else:
                h = h + layer.mixer(x)
        return self.layers[-1].final_layernorm(h)


def _causal_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """transformers' NemotronHAttention projections with plain causal SDPA (no positional encoding)."""
    b, t, _ = x.shape
    hd = attn.head_dim
    q = attn.q_proj(x).view(b, t, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, -1, hd).transpose(1, 2)
    v = attn.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scaling)
    return attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class TargetWithMTP(nn.Module):
    """transformers' NemotronHForCausalLM (``.lm``) + ``MTPHead`` (``.mtp``), trained jointly."""

    def __init__(self, config):
        super().__init__()
        from transformers import NemotronHForCausalLM

        self.lm = NemotronHForCausalLM(config)
        self.mtp = MTPHead(config)
        for m in self.mtp.modules():          # the target's own init rules (std initializer_range)
            self.lm._init_weights(m)

    def losses(self, window: torch.Tensor):
        """window [B, T+1] token ids -> (next-token CE, next-next-token CE via the MTP head)."""
        inp = window[:, :-1]
        hidden = self.lm.model(input_ids=inp).last_hidden_state                # [B, T, D] after norm_f
        logits = self.lm.lm_head(hidden).float()
        main = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        mtp_logits = self.mtp_logits(hidden[:, :-1], window[:, 1:-1])
        mtp = F.cross_entropy(mtp_logits.flatten(0, 1), window[:, 2:].flatten())
        return main, mtp

    def mtp_logits(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """hidden [B, P, D] (h_0..h_{P-1}), next_tokens [B, P] (t_1..t_P) -> logits of t_2..t_{P+1}."""
        emb = self.lm.model.embeddings(next_tokens)
        return self.lm.lm_head(self.mtp(emb, hidden)).float()


def draft_model(config):
    from transformers import NemotronHForCausalLM
    return NemotronHForCausalLM(config)


def draft_loss(model, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1]).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())


# ------------------------------------------------------------------------------------------ saving

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _cast(sd: dict, dtype: torch.dtype) -> dict:
    return {k: (v if k.endswith("e_score_correction_bias") or not v.is_floating_point() else v.to(dtype))
            .detach().cpu().contiguous() for k, v in sd.items()}


def save_hf(lm, out_dir: Path, *, save_dtype: str, config_dtype: str, tokenizer=None,
            extra_tensors: dict | None = None) -> Path:
    """``lm`` (a transformers NemotronHForCausalLM) as an HF folder: one model.safetensors in
    ``save_dtype`` (plus ``extra_tensors``, e.g. the MTP step), config.json with ``dtype`` =
    ``config_dtype``, generation_config.json, and the tokenizer files."""
    from safetensors.torch import save_file
    from hybrid_engine.models.synthetic import _quiet_transformers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = _DTYPES[save_dtype]
    sd = _cast(lm.state_dict(), dtype)
    if extra_tensors:
        sd.update(_cast(extra_tensors, dtype))
    save_file(sd, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = copy.deepcopy(lm.config)
    cfg.dtype = config_dtype
    with _quiet_transformers():
        cfg.save_pretrained(out_dir)
        if lm.generation_config is not None:
            gen = copy.deepcopy(lm.generation_config)
            gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = 0, 1, 2
            gen.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out_dir))
    return out_dir


def mtp_tensors(head: MTPHead) -> dict:
    """The head's tensors under their published names (``mtp.layers.{i}.*``, experts split)."""
    from hybrid_engine.models.synthetic import split_experts
    return {f"mtp.{k}": v for k, v in split_experts(head.state_dict()).items()}


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")


def load_target_with_mtp(folder, device="cpu") -> TargetWithMTP:
    """A saved target folder back as the training-time ``TargetWithMTP`` (float32): transformers'
    backbone and lm_head plus the ``mtp.*`` tensors in ``MTPHead`` (per-expert tensors re-stacked
    into transformers' merged [E, out, in] parameters). Tests use it to compare the training-time
    MTP math with the engine's."""
    import re
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = Path(folder)
    cfg = AutoConfig.from_pretrained(str(folder))
    model = TargetWithMTP(cfg).float()
    sd = load_file(str(folder / "model.safetensors"))
    lm_sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    missing, unexpected = model.lm.load_state_dict(lm_sd, strict=False)
    if unexpected or [k for k in missing if not k.endswith("e_score_correction_bias")]:
        raise ValueError(f"{folder}: backbone tensors do not match: missing {missing}, unexpected {unexpected}")
    per_expert = re.compile(r"^(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
    merged: dict[str, dict[int, torch.Tensor]] = {}
    mtp_sd = {}
    for k, v in sd.items():
        if not k.startswith("mtp."):
            continue
        k = k[len("mtp."):]
        m = per_expert.match(k)
        if m:
            merged.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = v
        else:
            mtp_sd[k] = v
    for k, parts in merged.items():
        mtp_sd[k] = torch.stack([parts[e] for e in range(len(parts))])
    model.mtp.load_state_dict({k: v.float() for k, v in mtp_sd.items()}, strict=True)
    return model.to(device).eval()
