"""Helpers shared by model-based drafters (draft model, MTP)."""
from __future__ import annotations

import torch

from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
from hybrid_engine.sampling.sampler import SamplingTensors, probs_from_logits, sample


def single_token_batch(tokens: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                       block_size: int, mamba_slots: torch.Tensor, valid: torch.Tensor,
                       max_seq_len: int) -> ForwardBatch:
    """One token per row on the decode path (Mamba offset 0). Rows with ``valid`` False write KV
    into the null block, so a row whose blocks end before ``positions`` never writes past them."""
    b = tokens.shape[0]
    dev = tokens.device
    col = (positions // block_size).clamp(max=block_tables.shape[1] - 1)
    slot_map = block_tables.long().gather(1, col[:, None]).squeeze(1) * block_size + positions % block_size
    slot_map = torch.where(valid, slot_map, positions % block_size)          # null block 0
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    attn = AttnMetadata(qsl, (positions + 1).to(torch.int32), block_tables, slot_map, 1, max_seq_len)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    mamba = MambaMetadata(b, 1, mamba_slots, torch.ones(b, dtype=torch.int64, device=dev),
                          torch.zeros(1, dtype=torch.int64, device=dev), (0,), empty,
                          torch.zeros(0, dtype=torch.bool, device=dev))
    return ForwardBatch(tokens, positions, attn, mamba, torch.arange(b, device=dev))


def draw(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor, want_probs: bool):
    """Draft token per row keyed like the target sampler (seed, position): greedy rows take the
    argmax. Returns (tokens [B], q [B, V] float32 or None)."""
    tok = sample(logits, st, positions)
    return tok, (probs_from_logits(logits, st) if want_probs else None)
