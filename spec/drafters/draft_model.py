"""A separate (smaller, hybrid) Nemotron-H as the drafter, with its own KV cache and Mamba pool.

Per step the draft first replays the target's exact forward batch on its own caches: the same
tokens, positions, block ids and Mamba slots, so its state follows the accepted tokens with the
same 1+K checkpoint scheme and the same accepted counts as the target. Then, from checkpoint a-1
(copied into a per-request scratch slot, so the persistent checkpoints stay intact), it decodes K
tokens autoregressively. Nothing here reads a device value on the host.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from hybrid_engine.attention import KVCache
from hybrid_engine.config import ModelConfig
from hybrid_engine.step.graphs import EagerExecutor, make_executor
from hybrid_engine.step.single_token_steps import SingleTokenSteps, single_token_meta
from hybrid_engine.models import build_model
from hybrid_engine.models.nemotron_h import Caches
from hybrid_engine.quantization.kv_scales import attach_kv_scales, check_fp8_scale_format
from hybrid_engine.mamba_cache.checkpoints import MambaCheckpoints
from hybrid_engine.mamba_cache.pool import MambaPool

from ..adaptive import draft_counts
from .base import CacheFootprint, DraftContext, Drafter
from .common import draw
from .draft_quant import add_fp8_copies, copies_bytes

logger = logging.getLogger("hybrid_engine")


class DraftModelDrafter(Drafter):
    has_probs = True             # random rows get draft probabilities (q differs from p)

    def __init__(self, model, model_cfg: ModelConfig, *, num_spec: int, max_num_seqs: int, num_blocks: int,
                 block_size: int, max_model_len: int, dtype, device, kv_dtype=None):
        """``dtype``: the model's; ``kv_dtype``: its KV cache's storage dtype (the engine's
        kv_cache_dtype; None: ``dtype``)."""
        self.model, self.num_spec, self.device, self.dtype = model, num_spec, device, dtype
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        mc = model_cfg
        self.kv = KVCache(len(mc.attention_layer_ids), num_blocks, block_size, mc.num_key_value_heads,
                          mc.head_dim, kv_dtype or dtype, device)
        # slots 1..M mirror the target's slots (persistent, 1+K checkpoints); M+1..2M are scratch
        self.pool = MambaPool(len(mc.mamba_layer_ids), 2 * max_num_seqs, mc.conv_dim, mc.conv_kernel,
                              mc.mamba_num_heads, mc.mamba_head_dim, mc.ssm_state_size, num_spec, dtype, device)
        self.caches = Caches(self.kv, self.pool)
        self.conv_width = mc.conv_kernel - 1
        self.vocab = mc.vocab_size
        self.verify_exec = self.step_exec = EagerExecutor(model, self.caches)
        # the single-token steps' constant tensors, and a row count no step reaches (every row of a
        # step on this path is real: single_token_meta's pads are the fused graphs' padding rows)
        self.single = SingleTokenSteps(max_num_seqs, device)
        self._all_real = torch.full((1,), 1 << 62, dtype=torch.int64, device=device)

    def _checkpoint_shape(self):
        mc = self.model.cfg
        return (len(mc.mamba_layer_ids), mc.conv_dim, mc.conv_kernel, mc.mamba_num_heads, mc.mamba_head_dim,
                mc.ssm_state_size)

    def checkpoint_bytes_per_row(self) -> int:
        return MambaCheckpoints.bytes_per_row(*self._checkpoint_shape(), self.dtype)

    def attach_checkpoints(self, num_rows: int) -> None:
        """The draft's own checkpoints: its replay of the target's forward batch restores and saves
        the same rows the target does, so its state follows the prefix cache too."""
        n, *shape = self._checkpoint_shape()
        self.caches.checkpoints = MambaCheckpoints(n, num_rows, *shape[:1], *shape[1:], self.dtype, self.device)

    def use_executors(self, make) -> None:
        """``make(model, caches, num_spec, name)`` -> executor: graphs for the replay ([B, 1+K])
        and for the autoregressive steps ([B, 1])."""
        self.verify_exec = make(self.model, self.caches, self.num_spec, "draft verify")
        self.step_exec = make(self.model, self.caches, 0, "draft step")

    def propose(self, ctx: DraftContext):
        k, m = ctx.drafts_wanted(self.num_spec), self.max_num_seqs
        if not k:      # the next step verifies none: the caches follow the step, nothing else
            self.verify_exec.follow(ctx.forward_batch)
            return ctx.num_valid.new_empty(ctx.num_valid.shape[0], 0), None
        self.verify_exec.forward(ctx.forward_batch)                # follow the target's step
        valid = ctx.num_valid > 0
        a = ctx.num_valid.clamp(min=1)
        scratch = ctx.slots + m
        self._fork(ctx.slots, scratch, a)
        st = ctx.sampling
        want_probs = not st.all_greedy
        tok = ctx.input_token
        bt = ctx.forward_batch.attn.block_tables
        max_seq = ctx.forward_batch.attn.max_seq_len + 2 * self.num_spec + 1
        # every single-token step's positions, KV slots and lengths [K, B] at once (one launch on
        # CUDA; built step by step, ~17 small launches a step were host time in a prefill step).
        # All K whatever k: the step count is the kernel's constexpr, so one compiled variant (the
        # fused graphs') serves every adaptive width instead of a compile per new k mid-serving
        pos, slots, seq_lens, _, _ = single_token_meta(
            ctx.input_pos.contiguous(), ctx.num_valid.contiguous(), self._all_real, bt, steps=self.num_spec,
            block_size=ctx.block_size, tokens_per_row=1, pads_advance=True)
        drafts, probs = [], []
        for j in range(k):
            fb = self.single.batch(tok, pos[j], seq_lens[j], slots[j], bt, scratch, max_seq)
            _, logits = self.step_exec.forward(fb)
            tok, q = draw(logits, st, pos[j] + 1, want_probs)
            drafts.append(tok)
            probs.append(q)
        out = torch.where(valid[:, None], torch.stack(drafts, 1), -1)
        return out, (torch.stack(probs, 1) if want_probs else None)

    def _fork(self, slots: torch.Tensor, scratch: torch.Tensor, a: torch.Tensor) -> None:
        """scratch state := the state after the last accepted token (checkpoint a-1, conv offset a-1)."""
        cols = (a - 1)[:, None] + torch.arange(self.conv_width, device=self.device)   # [B, W-1]
        conv, ssm = self.pool.conv_all, self.pool.ssm_all     # every layer at once: [L, S, C, W-1+K], [L, S, 1+K, ...]
        ssm[:, scratch, 0] = ssm[:, slots, a - 1]
        L, _, C, _ = conv.shape
        win = conv[:, slots].gather(3, cols[None, :, None, :].expand(L, -1, C, -1))      # [L, B, C, W-1]
        conv[:, scratch, :, :self.conv_width] = win


def cache_footprint(cfg) -> CacheFootprint:
    """The draft model's weights and Mamba pool (fixed) and its KV per target block id, read from
    its config.json and safetensors headers before anything is loaded: the engine subtracts them from
    the KV budget, so target + draft fit in ``kv_cache_memory_fraction`` together. With
    ``SpeculativeConfig.quantization``, plus the FP8 copies (counted on the model built on the
    meta device)."""
    from safetensors import safe_open

    draft_dir = Path(cfg.speculative.model).expanduser()
    mc = ModelConfig.from_json(draft_dir)
    itemsize = torch.empty((), dtype=cfg.dtype).element_size()
    numel = 0
    for f in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                numel += n
    k = cfg.speculative.num_speculative_tokens
    slots = 2 * cfg.scheduler.max_num_seqs + 1       # mirrors + scratch + null, as DraftModelDrafter
    conv = slots * (mc.conv_kernel - 1 + k) * mc.conv_dim * itemsize
    ssm = slots * (1 + k) * mc.mamba_num_heads * mc.mamba_head_dim * mc.ssm_state_size * 4
    pool = len(mc.mamba_layer_ids) * (conv + ssm)
    kv = KVCache.bytes_per_block(len(mc.attention_layer_ids), cfg.cache.block_size, mc.num_key_value_heads,
                                 mc.head_dim, cfg.cache.kv_dtype(cfg.dtype))
    copies = 0 if cfg.speculative.quantization is None else _copies_bytes(mc, cfg.dtype)
    return CacheFootprint(fixed_bytes=numel * itemsize + copies + pool, kv_bytes_per_block=kv)


def _copies_bytes(model_cfg, dtype) -> int:
    from hybrid_engine.models.families import FAMILIES
    with torch.device("meta"):
        model = FAMILIES[model_cfg.model_type].model_class()(model_cfg, with_mtp=False)
    return copies_bytes(model, dtype)


def make_draft_model(build) -> DraftModelDrafter:
    cfg = build.cfg
    spec = cfg.speculative
    draft_dir = Path(spec.model).expanduser()
    draft_cfg = ModelConfig.from_json(draft_dir)
    if draft_cfg.vocab_size != cfg.model.vocab_size:
        raise ValueError(f"speculative_config.model has vocab_size={draft_cfg.vocab_size}, but the target has "
                         f"{cfg.model.vocab_size}: a draft model must share the target's vocabulary")
    if spec.quantization is not None and draft_cfg.quantization is not None:
        raise ValueError(f"speculative_config.quantization={spec.quantization!r} quantizes a 16/32-bit draft "
                         f"model at load, but {draft_dir} is stored in {draft_cfg.quantization.method!r}; "
                         "leave quantization None to run it as stored")
    model = build_model(draft_cfg, draft_dir, cfg.dtype, cfg.device)
    if spec.quantization is not None:
        add_fp8_copies(model, "draft model")
    logger.info("draft model %s: %d layers (%s)", draft_dir, draft_cfg.num_layers, "".join(draft_cfg.layer_types))
    drafter = DraftModelDrafter(model, draft_cfg, num_spec=build.num_spec, max_num_seqs=build.max_num_seqs,
                                num_blocks=build.num_kv_blocks, block_size=build.block_size,
                                max_model_len=build.max_model_len, dtype=cfg.dtype, device=cfg.device,
                                kv_dtype=cfg.cache.kv_dtype(cfg.dtype))
    # the draft's KV follows the engine's kv_cache_dtype; FP8 scales: its own checkpoint's, else 1.0
    if cfg.cache.kv_fp8:
        check_fp8_scale_format(draft_cfg.quantization, cfg.cache.kv_cache_dtype, what="draft model")
    attach_kv_scales(drafter.kv, draft_dir, model, what="draft model")
    # the replay of the target's step takes every width the target's steps may have (adaptive), and
    # its steps of one prefill row replay prefill graphs (one GPU, as the target's): eagerly, the
    # draft's forward over a new prompt was host time the next step waited for (bench-large, H200,
    # batch 1, 32 new tokens: a prefill step's interval 7.1 ms against 1.6 ms without speculation;
    # benchmarks/results/2026-11-29-spec-prefill-step-h200.md)
    verify_widths = tuple(1 + c for c in draft_counts(spec, build.num_spec))
    drafter.use_executors(lambda m, c, k, name: make_executor(
        m, c, cfg, num_spec=k, max_blocks=build.max_blocks_per_req, max_model_len=build.max_model_len,
        block_size=build.block_size, name=name, widths=verify_widths if k else None,
        prefill_graphs=bool(k) and build.prefill_graphs, pad_restores=build.checkpoints))
    return drafter
