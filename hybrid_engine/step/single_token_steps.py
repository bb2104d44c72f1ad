"""The single-token steps of a model drafter's proposal inside a fused verify step (the MTP layers'
drafts 2..K, the draft model's K drafts), their metadata built at once.

Built one step at a time (``spec.drafters.common.single_token_batch``), each single-token step's
forward batch is ~18 small device ops (positions, block-table gather, slot mapping, lengths, and
constant ``arange`` / ``ones`` / ``zeros`` tensors) captured into the step graph: on the
bench-large target an MTP K = 3 step replayed 34 elementwise launches (43 us of GPU time,
results/2026-11-28-spec-step-glue-h100.md). Here:

- one launch (``_single_token_meta_kernel``; ``single_token_meta_ref`` is its torch twin) writes
  every step's positions, slot mapping and sequence lengths [S, B], each row's validity and the
  flat index of its newest sample;
- the constant tensors are made once, before capture (``SingleTokenSteps``), and sliced per bucket.

Real row b (b < N, the staged header) of step j (0-based) sits at ``next_start[b] + j``; a pad row
at j (``pads_advance``, the draft model) or at 0 (the MTP layers). A row's KV slot is its block's
slot where the row is valid (a real row that kept a token), else offset ``pos % block_size`` of the
null block 0. These are ``single_token_batch``'s values exactly (tests/spec/test_single_token_steps.py).
"""
from __future__ import annotations

import torch

from hybrid_engine.mamba_cache.ops.triton_common import device_ctx, kernel_backend, next_pow2, triton_available

from .forward_batch import AttnMetadata, ForwardBatch, MambaMetadata


def single_token_meta_ref(next_start: torch.Tensor, num_valid: torch.Tensor, num_real: torch.Tensor,
                          block_tables: torch.Tensor, *, steps: int, block_size: int, tokens_per_row: int,
                          pads_advance: bool) -> tuple[torch.Tensor, ...]:
    """next_start [B] int64, num_valid [B] int64, num_real [1] int64 (rows >= it are pads),
    block_tables [B, M] int32 -> (positions [S, B] int64, slot_mapping [S, B] int64, seq_lens
    [S, B] int32, valid [B] bool, newest [B] int64 = b * tokens_per_row + max(num_valid - 1, 0))."""
    B = next_start.shape[0]
    dev = next_start.device
    rows = torch.arange(B, device=dev)
    real = rows < num_real
    valid = (num_valid > 0) & real
    j = torch.arange(steps, device=dev)[:, None]                                  # [S, 1]
    pads = j.expand(steps, B) if pads_advance else torch.zeros_like(j).expand(steps, B)
    pos = torch.where(real[None, :], next_start[None, :] + j, pads)              # [S, B]
    col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    blk = block_tables.long().gather(1, col.t().contiguous()).t()                 # [S, B]
    off = pos % block_size
    slot = torch.where(valid[None, :], blk * block_size + off, off)
    newest = rows * tokens_per_row + (num_valid - 1).clamp(min=0)
    return pos, slot, (pos + 1).to(torch.int32), valid, newest


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["B", "M", "bs", "sbt_r", "tpr"])
    def _single_token_meta_kernel(ns_ptr, nv_ptr, nreal_ptr, bt_ptr, pos_ptr, slot_ptr, sl_ptr, valid_ptr,
                                  newest_ptr, B, M, bs, sbt_r, tpr,
                                  S: tl.constexpr, BLOCK_S: tl.constexpr, PADS_ADVANCE: tl.constexpr):
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK_S)
        mj = j < S
        zero_j = tl.zeros([BLOCK_S], dtype=tl.int64)
        # full-shape loads and masks (a scalar & block mask trips the interpreter)
        n_real = tl.load(nreal_ptr + zero_j)
        real = (zero_j + b) < n_real
        ns = tl.load(ns_ptr + b + zero_j)
        nv = tl.load(nv_ptr + b + zero_j)
        valid = (nv > 0) & real
        jj = j.to(tl.int64)
        pos = tl.where(real, ns + jj, jj if PADS_ADVANCE else zero_j)
        col = tl.minimum(pos // bs, M - 1)
        blk = tl.load(bt_ptr + b.to(tl.int64) * sbt_r + col, mask=mj, other=0).to(tl.int64)
        off = pos % bs
        slot = tl.where(valid, blk * bs + off, off)
        out = jj * B + b
        tl.store(pos_ptr + out, pos, mask=mj)
        tl.store(slot_ptr + out, slot, mask=mj)
        tl.store(sl_ptr + out, (pos + 1).to(tl.int32), mask=mj)
        first = j == 0
        tl.store(valid_ptr + b + zero_j, valid, mask=first)
        tl.store(newest_ptr + b + zero_j, b.to(tl.int64) * tpr + tl.maximum(nv - 1, 0), mask=first)


def single_token_meta(next_start, num_valid, num_real, block_tables, *, steps: int, block_size: int,
                      tokens_per_row: int, pads_advance: bool) -> tuple[torch.Tensor, ...]:
    """``single_token_meta_ref``'s results in one launch on CUDA (the reference elsewhere)."""
    fn = (single_token_meta_triton if kernel_backend("single_token_meta", next_start.device) == "triton"
          else single_token_meta_ref)
    return fn(next_start, num_valid, num_real, block_tables, steps=steps, block_size=block_size,
              tokens_per_row=tokens_per_row, pads_advance=pads_advance)


def single_token_meta_triton(next_start, num_valid, num_real, block_tables, *, steps: int, block_size: int,
                             tokens_per_row: int, pads_advance: bool) -> tuple[torch.Tensor, ...]:
    """The kernel (any device Triton runs on: the interpreter's CPU tensors in the tests)."""
    B, M = block_tables.shape
    if next_start.stride(0) != 1 or num_valid.stride(0) != 1 or block_tables.stride(1) != 1:
        raise ValueError("single_token_meta: next_start / num_valid / block_tables rows need unit strides")
    dev = next_start.device
    pos = torch.empty((steps, B), dtype=torch.int64, device=dev)
    slot = torch.empty((steps, B), dtype=torch.int64, device=dev)
    seq_lens = torch.empty((steps, B), dtype=torch.int32, device=dev)
    valid = torch.empty(B, dtype=torch.bool, device=dev)
    newest = torch.empty(B, dtype=torch.int64, device=dev)
    if B:
        with device_ctx(next_start):
            _single_token_meta_kernel[(B,)](next_start, num_valid, num_real, block_tables, pos, slot, seq_lens,
                                            valid, newest, B, M, block_size, block_tables.stride(0),
                                            tokens_per_row, S=steps, BLOCK_S=next_pow2(max(steps, 1)),
                                            PADS_ADVANCE=pads_advance, num_warps=1)
    return pos, slot, seq_lens, valid, newest


class SingleTokenSteps:
    """The constant parts of single-token forward batches for up to ``max_rows`` rows, made once
    (outside graph capture, so replays launch nothing for them), and the batches built from them."""

    def __init__(self, max_rows: int, device):
        dev = torch.device(device)
        self.qsl = torch.arange(max_rows + 1, dtype=torch.int32, device=dev)        # [Bmax+1]
        self.ones = torch.ones(max_rows, dtype=torch.int64, device=dev)             # [Bmax] num_accepted
        self.zero_slots = torch.zeros(max_rows, dtype=torch.int64, device=dev)      # [Bmax] unused Mamba slots
        self.rows = torch.arange(max_rows, dtype=torch.int64, device=dev)           # [Bmax] logits indices
        self.zero1 = torch.zeros(1, dtype=torch.int64, device=dev)                  # [1] prefill query starts
        self.empty = torch.zeros(0, dtype=torch.int64, device=dev)
        self.empty_bool = torch.zeros(0, dtype=torch.bool, device=dev)

    def batch(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
              slot_mapping: torch.Tensor, block_tables: torch.Tensor, mamba_slots: torch.Tensor | None,
              max_seq_len: int) -> ForwardBatch:
        """One token per row ([B] each; ``mamba_slots`` None: the model has no Mamba layers): the
        forward batch ``single_token_batch`` builds from the same values."""
        b = tokens.shape[0]
        attn = AttnMetadata(self.qsl[:b + 1], seq_lens, block_tables, slot_mapping, 1, max_seq_len)
        mamba = MambaMetadata(b, 1, self.zero_slots[:b] if mamba_slots is None else mamba_slots, self.ones[:b],
                              self.zero1, (0,), self.empty, self.empty_bool)
        return ForwardBatch(tokens, positions, attn, mamba, self.rows[:b])
