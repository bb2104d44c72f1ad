"""Typed hand-off from the runner's input preparation to the model forward.

Token order inside a step: decode/verify rows first (each exactly ``decode_len`` tokens), then the
prefill chunks. Every tensor lives on the model device; host-side ints are upper bounds used only to
size padded buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttnMetadata:
    query_start_loc: torch.Tensor   # [B+1] int32, step-row space
    seq_lens: torch.Tensor          # [B] int32, tokens in cache after this step (decode rows: device-corrected)
    block_tables: torch.Tensor      # [B, max_blocks] int32, step-row space
    slot_mapping: torch.Tensor      # [T] int64, flat KV slot per token
    max_query_len: int              # host upper bound
    max_seq_len: int                # host upper bound


@dataclass(frozen=True)
class MambaMetadata:
    num_decode_rows: int            # N_d: rows on the verify path (first in token order)
    decode_len: int                 # s = 1 + K tokens per decode row
    decode_slots: torch.Tensor      # [N_d] int64 pool slots
    num_accepted: torch.Tensor      # [N_d] int64 >= 1: accepted count of the previous step (state offset + 1)
    prefill_query_start_loc: torch.Tensor  # [B_p+1] int64, relative to the first prefill token
    prefill_qsl_cpu: tuple[int, ...]       # same on the host (exact: prefill lengths are CPU-known)
    prefill_slots: torch.Tensor     # [B_p] int64 pool slots
    has_initial_state: torch.Tensor # [B_p] bool: chunk continues an earlier chunk
    # prefix caching (None when the step restores / saves nothing; only prefill rows do):
    restore_slots: torch.Tensor | None = None  # [R] int64 pool slots restored before the forward
    restore_rows: torch.Tensor | None = None   # [R] int64 checkpoint rows they restore
    ckpt_seq: torch.Tensor | None = None      # [M] int64 prefill row of each save
    ckpt_token: torch.Tensor | None = None    # [M] int64 prefill-token index of the last token before the boundary
    ckpt_rows: torch.Tensor | None = None     # [M] int64 checkpoint rows written
    # the SSD kernels' chunk layout by chunk size, made by ssd_chunk_layout once a step (see there);
    # not an __init__ field, so dataclasses.replace (a new query_start_loc) starts an empty one
    _chunk_layouts: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def ssd_chunk_layout(self, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(prefill query_start_loc [B_p+1] int32, cumulative chunk counts [B_p] int32) for the
        Triton SSD scan: computed on the device by the step's first Mamba layer, reused by the
        others (a handful of small ops a step instead of per layer; no host sync)."""
        got = self._chunk_layouts.get(chunk_size)
        if got is None:
            qsl = self.prefill_query_start_loc
            cum = torch.cumsum((qsl[1:] - qsl[:-1] + (chunk_size - 1)) // chunk_size, 0).to(torch.int32)
            got = self._chunk_layouts[chunk_size] = (qsl.to(torch.int32), cum)
        return got

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_rows * self.decode_len

    @property
    def max_prefill_len(self) -> int:
        q = self.prefill_qsl_cpu
        return max((b - a for a, b in zip(q, q[1:])), default=0)

    @property
    def num_prefill_rows(self) -> int:
        return len(self.prefill_qsl_cpu) - 1


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor         # [T] int64, never -1 (placeholders are clamped before this)
    positions: torch.Tensor         # [T] int64 absolute positions (NoPE models ignore them; RoPE hook)
    attn: AttnMetadata
    mamba: MambaMetadata
    logits_indices: torch.Tensor    # [L] int64 token indices whose logits are computed
