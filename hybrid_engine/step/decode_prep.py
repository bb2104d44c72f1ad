"""Decode-only step inputs in one launch: every field gathered from the previous step's outputs.

A step whose rows are all decode/verify rows takes its tokens, positions and Mamba accepted counts
from the previous step's device outputs (through ``prev``: the row's index in that step) and only
three small arrays from the host (``prev``, the pool slot and the block-table row). As torch ops
that is ~12 launches, plus ~18 copies into a CUDA graph's static buffers; ``prepare_decode`` writes
every field straight into the destination buffers (a graph bucket's own when one is replayed),
padding rows included, in one Triton launch on CUDA. ``prepare_decode_ref`` is its torch twin
(CPU, and the oracle in the tests).

Host staging, one int64 array ``staged``: ``[prev (N), slot (N), block table rows (N x W)]``
(W = ``block_cols``: the widest row's block count).

Per real row r < N, with p = prev[r], s = ``tokens_per_row`` = 1 + K, start = prev_next_start[p]:
- accepted a = max(prev_num_valid[p], 1) if the previous step may have kept several tokens per row
  (``gather_accepted``: its ``sampled`` has more than one column) else 1 (the Mamba state offset + 1);
- input_ids[r*s + j] = prev_sampled[p, a-1] for j = 0, max(prev_drafts[p, j-1], 0) for j >= 1;
- positions[r*s + j] = start + j; slot_mapping = block_table[r, pos // bs] * bs + pos % bs;
- seq_lens[r] = start + s; block_tables[r] = the staged row, zeros past W; decode_slots[r] = slot;
- start_out[r] = start; drafts_out[r] = prev_drafts[p] (K > 0); next_start_out[r] = start + 1 (K = 0:
  every decode row of a K = 0 step yields exactly one token, so its next start is known now).
K is this step's draft count (adaptive speculation: 0..num_speculative_tokens, ``prev_drafts`` is [Bp, K]).
Padding rows N <= r < R (graph buckets): token 0, position 0, slot mapping 0 (the null block),
seq_len s, an all-zero block-table row, the null Mamba slot, accepted count 1.

``header=True`` (CUDA kernel only): ``staged`` starts with ``[N, W]`` and the kernel reads them
from there instead of its arguments, so one captured launch serves every N <= R and W
(``greedy_graphs``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_engine.mamba_cache import NULL_SLOT


@dataclass(frozen=True)
class DecodeDest:
    """Where ``prepare_decode`` writes: R >= N rows (R > N only for a CUDA-graph bucket)."""
    input_ids: torch.Tensor      # [>= R*s] int64
    positions: torch.Tensor      # [>= R*s] int64
    slot_mapping: torch.Tensor   # [>= R*s] int64
    seq_lens: torch.Tensor       # [R] int32
    block_tables: torch.Tensor   # [R, M] int32, M >= W
    decode_slots: torch.Tensor   # [R] int64
    num_accepted: torch.Tensor   # [R] int64

    @property
    def rows(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class PrevOutputs:
    """The previous step's device outputs, in its step-row space."""
    sampled: torch.Tensor        # [Bp, s] int64
    num_valid: torch.Tensor      # [Bp] int64 (read only when K > 0)
    next_start: torch.Tensor     # [Bp] int64
    drafts: torch.Tensor         # [Bp, K] int64


def prepare_decode(staged: torch.Tensor, n: int, block_cols: int, prev: PrevOutputs, dest: DecodeDest, *,
                   block_size: int, num_spec: int, start_out: torch.Tensor, drafts_out: torch.Tensor | None,
                   next_start_out: torch.Tensor | None) -> None:
    """Fill ``dest`` (all R rows), ``start_out`` [N], ``drafts_out`` [N, K] (K > 0) and
    ``next_start_out`` [N] (K = 0) from ``staged`` (see the module docstring)."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("prepare_decode", staged.device) == "triton":
        from .triton_decode_prep import triton_prepare_decode
        return triton_prepare_decode(staged, n, block_cols, prev, dest, block_size=block_size, num_spec=num_spec,
                                     start_out=start_out, drafts_out=drafts_out, next_start_out=next_start_out)
    return prepare_decode_ref(staged, n, block_cols, prev, dest, block_size=block_size, num_spec=num_spec,
                              start_out=start_out, drafts_out=drafts_out, next_start_out=next_start_out)


def gathers_accepted(prev: PrevOutputs) -> bool:
    """Whether a row of the previous step may have kept more than one token (host-known shape):
    then its accepted count and last token are read from ``num_valid``, else they are 1 and column 0."""
    return prev.sampled.shape[1] > 1


def prepare_decode_ref(staged: torch.Tensor, n: int, block_cols: int, prev: PrevOutputs, dest: DecodeDest, *,
                       block_size: int, num_spec: int, start_out: torch.Tensor, drafts_out: torch.Tensor | None,
                       next_start_out: torch.Tensor | None) -> None:
    tokens_per_row, k, bs = 1 + num_spec, num_spec, block_size
    R = dest.rows
    dev = staged.device
    p = staged[:n]
    slots = staged[n:2 * n]
    bt = staged[2 * n:2 * n + n * block_cols].view(n, block_cols)
    start = prev.next_start[p]                                           # [N]
    if gathers_accepted(prev):
        accepted = prev.num_valid[p].clamp(min=1)
        last = prev.sampled[p].gather(1, (accepted - 1)[:, None])        # [N, 1]
    else:
        accepted = torch.ones(n, dtype=torch.int64, device=dev)
        last = prev.sampled[p][:, :1]
    if k:
        drafts = prev.drafts[p]
        ids = torch.cat([last, drafts.clamp(min=0)], 1)                  # [N, tokens_per_row]
        drafts_out.copy_(drafts)
    else:
        ids = last
        next_start_out.copy_(start + 1)
    pos = start[:, None] + torch.arange(tokens_per_row, device=dev)  # [N, tokens_per_row]
    slot_map = bt.gather(1, pos // bs) * bs + pos % bs
    start_out.copy_(start)
    num_tokens = n * tokens_per_row
    dest.input_ids[:num_tokens].copy_(ids.reshape(-1))
    dest.positions[:num_tokens].copy_(pos.reshape(-1))
    dest.slot_mapping[:num_tokens].copy_(slot_map.reshape(-1))
    dest.seq_lens[:n].copy_(start + tokens_per_row)
    dest.block_tables[:n, :block_cols].copy_(bt)
    dest.block_tables[:n, block_cols:].zero_()
    dest.decode_slots[:n].copy_(slots)
    dest.num_accepted[:n].copy_(accepted)
    # padding rows
    dest.input_ids[num_tokens:R * tokens_per_row].zero_()
    dest.positions[num_tokens:R * tokens_per_row].zero_()
    dest.slot_mapping[num_tokens:R * tokens_per_row].zero_()
    dest.seq_lens[n:].fill_(tokens_per_row)
    dest.block_tables[n:].zero_()
    dest.decode_slots[n:].fill_(NULL_SLOT)
    dest.num_accepted[n:].fill_(1)
