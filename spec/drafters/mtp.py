"""MTP drafter: the checkpoint's multi-token-prediction layers, fed the target's hidden states.

Per step: (1) replay the target's forward batch through the MTP layers with inputs shifted by one
token (pair i = (target hidden h_i, token t_{i+1})), so the MTP KV cache follows every computed
position; the pair at the token that produced each row's newest sample gives draft 1. A step with
prefill rows writes only the pairs' KV (``MTP.follow``) and takes draft 1 as a single-token step at
that pair (which rewrites that pair's KV): the same drafts up to float rounding, in fewer launches.
(2) K-1 single-token steps, each fed the previous MTP hidden state and the previous draft.
Embedding and lm_head are the target's. No Mamba state: rejected positions' KV is overwritten later.
"""
from __future__ import annotations

import logging

import torch

from hybrid_engine.attention import KVCache
from hybrid_engine.models.nemotron_h import Caches
from hybrid_engine.quantization.kv_scales import attach_kv_scales

from .base import CacheFootprint, DraftContext, Drafter
from .common import draw, single_token_batch
from .draft_quant import add_fp8_copies, copies_bytes, copy_bytes
from .draft_vocab import DraftVocabHead

logger = logging.getLogger("hybrid_engine")


class MTPDrafter(Drafter):
    has_probs = True             # random rows get draft probabilities (q differs from p)

    def __init__(self, target, *, num_spec: int, num_blocks: int, block_size: int, kv_dtype, device,
                 draft_vocab_size: int | None = None, quantization: str | None = None):
        """``kv_dtype``: the KV cache's storage dtype (the engine's kv_cache_dtype: the model dtype or FP8).
        ``draft_vocab_size``: drafts scored over the first that many vocabulary rows (draft_vocab.py).
        ``quantization`` ("fp8"): FP8 copies of the MTP block's linear layers and of the lm_head
        rows the drafts score, read by few-row calls (draft_quant.py)."""
        cfg = target.cfg
        self.target, self.mtp, self.num_spec = target, target.mtp, num_spec
        if quantization is not None:
            add_fp8_copies(self.mtp, "MTP drafter")
        # [L, D] final-normed MTP hidden -> [L, V] float32 draft logits, and -> [L] greedy draft ids
        head = None
        if draft_vocab_size is not None or quantization is not None:
            head = DraftVocabHead(target, draft_vocab_size or cfg.vocab_size, quantization=quantization)
        self.draft_logits = target.compute_logits if head is None else head
        self.draft_argmax = (lambda normed: target.compute_logits(normed).argmax(-1)) if head is None else head.argmax
        self.kv = KVCache(self.mtp.num_attention_layers, num_blocks, block_size, cfg.num_key_value_heads,
                          cfg.head_dim, kv_dtype, device)
        self.caches = Caches(self.kv, None)
        self.graphs = None            # an MTPGraphs on CUDA with graphs on (make_mtp): verify 1+K, steps
        self.verify_graphs = {}       # verify-pass graphs by tokens per row (1+K and adaptive widths)

    def follow(self, tokens, prev_hidden, fb) -> None:
        """The MTP KV of the step's pairs, nothing else (``MTP.follow``): a step after which the
        next verifies no drafts."""
        self.mtp.follow(self.target.backbone.embeddings(tokens), prev_hidden, fb, self.caches)

    def _step(self, tokens, prev_hidden, fb, rows=None):
        """-> (MTP hidden, final-normed hidden), each [T, D], or [R, D] at ``rows`` [R]: the MTP KV
        of every token either way (``MTP.forward``)."""
        return self.mtp(self.target.backbone.embeddings(tokens), prev_hidden, fb, self.caches, rows)

    @staticmethod
    def pair_tokens(ctx: DraftContext) -> torch.Tensor:
        """[T] the token after each of the step's input tokens (pair i's t_{i+1}): host-known
        inside prefill chunks, the step's new samples elsewhere (placeholders -1 as 0)."""
        fb = ctx.forward_batch
        valid = ctx.num_valid > 0
        shifted = ctx.next_input_ids.clone()
        shifted[:fb.mamba.num_decode_tokens] = ctx.sampled[:fb.mamba.num_decode_rows].reshape(-1)
        last_tok = ctx.query_start_loc[1:] - 1
        is_prefill = ~ctx.is_decode
        shifted[last_tok] = torch.where(is_prefill & valid, ctx.sampled[:, 0], shifted[last_tok])
        return shifted.clamp(min=0)

    def propose(self, ctx: DraftContext):
        fb = ctx.forward_batch
        valid = ctx.num_valid > 0
        tokens = self.pair_tokens(ctx)
        k = ctx.drafts_wanted(self.num_spec)
        if not k:      # the MTP KV follows every step, drafts or not: at k = 0 the KV alone
            self.follow(tokens, ctx.hidden, fb)
            return ctx.num_valid.new_empty(ctx.num_valid.shape[0], 0), None
        pos = ctx.input_pos                                  # position of the newest sample
        bt = fb.attn.block_tables
        max_seq = fb.attn.max_seq_len + 2 * self.num_spec + 1
        if fb.mamba.num_prefill_rows:
            # a step with prefill rows: the MTP KV of every pair (``follow``: a few launches), then
            # draft 1 as a single-token step at each row's newest pair (h at token_index, the
            # newest sample), a graph replay where one fits. Eagerly, the whole MTP pass over the
            # step's tokens was ~60 launches of host work a new request waited for (a 96-token
            # prompt at batch 1: +2.3 ms a request on the H200, where the prefill's GPU work did
            # not hide it; results/2026-11-29-spec-rest-cost-gate-h200.md)
            self.follow(tokens, ctx.hidden, fb)
            hidden, logits = self._single(ctx.input_token, ctx.hidden[ctx.token_index], (pos - 1).clamp(min=0),
                                          bt, valid, ctx.block_size, max_seq)
        else:
            hidden, logits = self._verify(tokens, ctx.hidden, fb, ctx.token_index)
        st = ctx.sampling
        want_probs = not st.all_greedy
        tok, q = draw(logits, st, pos + 1, want_probs)
        drafts, probs = [tok], [q]
        for j in range(1, k):
            # pair index pos + j - 1: the previous MTP hidden stands in for the target's
            hidden, logits = self._single(tok, hidden, pos + j - 1, bt, valid, ctx.block_size, max_seq)
            tok, q = draw(logits, st, pos + j + 1, want_probs)
            drafts.append(tok)
            probs.append(q)
        out = torch.where(valid[:, None], torch.stack(drafts, 1), -1)
        return out, (torch.stack(probs, 1) if want_probs else None)

    def _verify(self, tokens, hidden, fb, idx):
        """The MTP over the step's tokens -> (MTP hidden [B, D], logits [B, V]) at idx [B]; a
        decode-only step within the graphs' buckets replays a graph."""
        md = fb.mamba
        g = self.verify_graphs.get(md.decode_len)
        if g is not None and not md.num_prefill_rows and 0 < md.num_decode_rows <= g.max_rows:
            return g.verify(tokens, hidden, fb, idx)
        h, normed = self._step(tokens, hidden, fb, idx)
        return h, self.draft_logits(normed)

    def _single(self, tok, hidden, pos, block_tables, valid, block_size: int, max_seq: int):
        """One token per row -> (MTP hidden [B, D], logits [B, V]); a graph replay when one fits."""
        g = self.graphs
        if g is not None and tok.shape[0] <= g.max_rows:
            return g.step(tok, hidden, pos, block_tables, valid)
        fb = single_token_batch(tok, pos, block_tables, block_size, torch.zeros_like(pos), valid, max_seq)
        h, normed = self._step(tok, hidden, fb)
        return h, self.draft_logits(normed)


def cache_footprint(cfg) -> CacheFootprint:
    """The MTP block's own KV per target block id (its attention layers; its weights are loaded with
    the target before the KV budget is taken): without it the KV of an MTP engine outgrew
    ``kv_cache_memory_fraction`` by the ratio of MTP to target attention layers."""
    from hybrid_engine.config import ATTENTION

    mc, spec = cfg.model, cfg.speculative
    n_attn = sum(kind == ATTENTION for kind in mc.mtp_layer_types)
    # FP8 drafting: the copies of the lm_head rows the drafts score and of the MTP block's linear
    # layers (none is made of a layer that is quantized already: then an over-count)
    copies = 0 if spec.quantization is None else (
        copy_bytes(spec.draft_vocab_size or mc.vocab_size, mc.hidden_size) + _mtp_copies_bytes(mc, cfg.dtype))
    return CacheFootprint(fixed_bytes=copies, kv_bytes_per_block=KVCache.bytes_per_block(
        n_attn, cfg.cache.block_size, mc.num_key_value_heads, mc.head_dim, cfg.cache.kv_dtype(cfg.dtype)))


def _mtp_copies_bytes(model_cfg, dtype) -> int:
    """Bytes of the MTP block's FP8 copies, counted on the block built on the meta device (no
    memory, no weight files needed)."""
    from hybrid_engine.models.mtp import MTP
    with torch.device("meta"):
        block = MTP(model_cfg)
    return copies_bytes(block, dtype)


def make_mtp(build) -> MTPDrafter:
    cfg = build.cfg
    if not hasattr(build.model, "mtp"):
        raise ValueError("speculative method 'mtp' needs the target built with its MTP layers")
    # the MTP block's KV follows the engine's kv_cache_dtype (scales: its mtp.* layers' own, else 1.0)
    rows = cfg.speculative.draft_vocab_size
    drafter = MTPDrafter(build.model, num_spec=build.num_spec, num_blocks=build.num_kv_blocks,
                         block_size=build.block_size, kv_dtype=cfg.cache.kv_dtype(cfg.dtype), device=cfg.device,
                         draft_vocab_size=rows, quantization=cfg.speculative.quantization)
    if rows is not None:
        logger.info("MTP drafter: drafts over the first %d of %d vocabulary rows", rows, cfg.model.vocab_size)
    attach_kv_scales(drafter.kv, cfg.model_dir, build.model, mtp=True, what="MTP")
    if cfg.device.type != "cuda" or cfg.enforce_eager:
        logger.info("MTP drafter: eager (%s)", "enforce_eager" if cfg.enforce_eager else cfg.device.type)
        return drafter
    from hybrid_engine.step.graphs import default_buckets
    from ..adaptive import draft_counts
    from .mtp_graphs import MTPGraphs
    kw = dict(buckets=default_buckets(build.max_num_seqs), block_size=build.block_size,
              max_blocks=build.max_blocks_per_req, max_model_len=build.max_model_len, device=cfg.device)
    try:
        drafter.graphs = MTPGraphs(drafter, **kw)
        drafter.verify_graphs = {drafter.graphs.tokens_per_row: drafter.graphs}
        for c in draft_counts(cfg.speculative, build.num_spec):   # narrower steps (adaptive speculation)
            if 1 + c not in drafter.verify_graphs:
                drafter.verify_graphs[1 + c] = MTPGraphs(drafter, tokens_per_row=1 + c, with_step=False, **kw)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:   # e.g. an op that cannot be captured
        logger.warning("MTP drafter: eager (graph capture failed: %s: %s)", type(exc).__name__, exc)
        drafter.graphs, drafter.verify_graphs = None, {}
        torch.cuda.empty_cache()
    return drafter
