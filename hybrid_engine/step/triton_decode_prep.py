"""Triton kernel of ``decode_prep.prepare_decode``: one program per destination row (real or pad)."""
from __future__ import annotations

import triton
import triton.language as tl

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops.triton_common import FastLaunch, device_ctx, next_pow2


@triton.jit(do_not_specialize=["n", "block_cols", "M", "bs", "ss_r", "sd_r", "sbt_r"])
def _prepare_decode_kernel(
    staged_ptr, sampled_ptr, nvalid_ptr, nstart_ptr, pdrafts_ptr,
    ids_ptr, pos_ptr, smap_ptr, seqlen_ptr, bt_ptr, dslot_ptr, acc_ptr,
    start_ptr, drafts_ptr, next_ptr,
    n, block_cols, M, bs, ss_r, sd_r, sbt_r,
    S: tl.constexpr, K: tl.constexpr, ACC: tl.constexpr, NULL: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_W: tl.constexpr, HDR: tl.constexpr,
):
    r = tl.program_id(0)
    if HDR:     # [n, W] lead the staged array (a CUDA graph replays with the n and W of each step)
        n = tl.load(staged_ptr).to(tl.int32)
        block_cols = tl.load(staged_ptr + 1).to(tl.int32)
        staged_ptr = staged_ptr + 2
    j = tl.arange(0, BLOCK_S)
    mj = j < S
    cols = tl.arange(0, BLOCK_W)
    # full-shape masks everywhere (a scalar & block mask trips the interpreter)
    real_j = (tl.zeros([BLOCK_S], dtype=tl.int32) + r) < n
    real_c = (tl.zeros([BLOCK_W], dtype=tl.int32) + r) < n
    real_1 = (tl.zeros([1], dtype=tl.int32) + r) < n
    o1 = tl.arange(0, 1)
    # the three host values of this row (pads read nothing: their loads are masked off)
    p = tl.load(staged_ptr + r + o1, mask=real_1, other=0)
    slot = tl.load(staged_ptr + n + r + o1, mask=real_1, other=NULL)
    start = tl.load(nstart_ptr + p, mask=real_1, other=0)
    if ACC:     # the previous step may have kept several tokens per row (it verified drafts)
        a = tl.maximum(tl.load(nvalid_ptr + p, mask=real_1, other=1), 1)
    else:
        a = tl.zeros([1], dtype=tl.int64) + 1
    if K > 0:
        last = tl.load(sampled_ptr + p * ss_r + a - 1, mask=real_1, other=0)
        dj = tl.maximum(j - 1, 0)
        dr = tl.load(pdrafts_ptr + p * sd_r + dj, mask=real_j & mj & (j >= 1), other=0)   # [BLOCK_S]
        ids = tl.where(j == 0, last, tl.maximum(dr, 0))
        tl.store(drafts_ptr + r * K + dj, dr, mask=real_j & mj & (j >= 1))
    else:
        ids = tl.load(sampled_ptr + p * ss_r + (a - 1) + j * 0, mask=real_j & mj, other=0)
        tl.store(next_ptr + r + o1, start + 1, mask=real_1)
    pos = start + j                                                                # [BLOCK_S]
    bcol = pos // bs
    blk = tl.load(staged_ptr + 2 * n + r * block_cols + bcol, mask=real_j & mj & (bcol < block_cols), other=0)
    smap = blk * bs + pos % bs
    ids = tl.where(real_j, ids, 0)
    pos = tl.where(real_j, pos, 0)
    smap = tl.where(real_j, smap, 0)
    tl.store(ids_ptr + r * S + j, ids, mask=mj)
    tl.store(pos_ptr + r * S + j, pos, mask=mj)
    tl.store(smap_ptr + r * S + j, smap, mask=mj)
    tl.store(seqlen_ptr + r + o1, tl.where(real_1, start + S, S).to(tl.int32))
    tl.store(dslot_ptr + r + o1, tl.where(real_1, slot, NULL))
    tl.store(acc_ptr + r + o1, tl.where(real_1, a, 1))
    tl.store(start_ptr + r + o1, start, mask=real_1)
    for c0 in range(0, M, BLOCK_W):
        c = c0 + cols
        v = tl.load(staged_ptr + 2 * n + r * block_cols + c, mask=real_c & (c < block_cols), other=0)
        tl.store(bt_ptr + r * sbt_r + c, v.to(tl.int32), mask=c < M)


_launch = FastLaunch(_prepare_decode_kernel)


def triton_prepare_decode(staged, n, block_cols, prev, dest, *, block_size, num_spec, start_out, drafts_out,
                          next_start_out, header=False) -> None:
    s, k = 1 + num_spec, num_spec
    acc = prev.sampled.shape[1] > 1          # decode_prep.gathers_accepted
    R = dest.rows
    M = dest.block_tables.shape[1]
    assert dest.block_tables.stride(1) == 1 and prev.sampled.stride(1) == 1
    dummy = start_out
    with device_ctx(staged):
        _launch((R,),
            staged, prev.sampled, prev.num_valid if acc else dummy, prev.next_start,
            prev.drafts if k else dummy,
            dest.input_ids, dest.positions, dest.slot_mapping, dest.seq_lens, dest.block_tables,
            dest.decode_slots, dest.num_accepted, start_out, drafts_out if k else dummy,
            next_start_out if not k else dummy,
            n, block_cols, M, block_size, prev.sampled.stride(0), prev.drafts.stride(0) if k else 0,
            dest.block_tables.stride(0),
            S=s, K=k, ACC=acc, NULL=NULL_SLOT, BLOCK_S=next_pow2(s), BLOCK_W=min(512, max(16, next_pow2(M))),
            HDR=header, num_warps=1,
        )
