"""The n-gram drafter's per-step device work (append + search) as ONE Triton launch.

``NgramDrafter`` (ngram.py) keeps its torch ``_append`` / ``_search`` as the CPU path and as the
oracle; on CUDA ``propose`` calls ``NgramTritonKernel`` instead: one program per step row, which

1. appends the row's valid sampled tokens to its slot row of the history store (token j < a at
   position ``input_pos - a + 1 + j``; positions >= max_len are dropped) and, if a > 0, sets
   ``length[slot] = min(input_pos + 1, max_len)`` (a = 0: nothing is written, length is kept);
2. barriers (the search reads what other threads of the program just stored), then searches the
   row exactly like ``NgramDrafter._search``: backward coordinates, ``rev[v]`` = the v-th last
   token (-1 before position 0); for every candidate occurrence end v in [1, W-1] the match run
   ``run[v]`` = leading t < m with ``v + t < W`` and ``rev[v + t] == rev[t]``; n = min(run, L - 1);
   the best occurrence maximises the score ``n * W - v`` over n >= min_n (longest n, then the most
   recent). The window is walked in blocks of BLOCK candidate ends, nearest first, with m shifted
   loads per block, and the walk stops as soon as a block holds an occurrence of the longest n
   possible (min(m, L - 1)): no later (farther) block can beat it. Candidates with v > L need no
   visit: there every rev[v + t] is -1, so v = L matches at least as long and is more recent;
3. writes the K tokens after the best occurrence (-1 at or past ``length``; -1 for rows without a
   match and rows with a = 0) to a fresh [B, K] int64 tensor.

Rows of one step must have distinct slots when they sampled something (a > 0), as in the engine
(a row is a scheduled request and each request holds its own slot); a row with a = 0 writes
nothing, so it may share a slot (e.g. a padding row on the null slot) with any other row.

No host synchronisation: the wrapper reads only shapes, allocates the output and launches.
Triton is imported when this module is: ngram.py imports it only when it chose the Triton backend.
"""
from __future__ import annotations

import torch

from hybrid_engine.mamba_cache.ops import triton_common
from hybrid_engine.mamba_cache.ops.triton_common import device_ctx, next_pow2, triton_available

if triton_available():
    import triton
    import triton.language as tl

    # every int argument unspecialised (a value compiled as 1 or as a multiple of 16 is not baked
    # in), as FastLaunch's direct launches require
    @triton.jit(do_not_specialize=["s_store", "s_slots", "s_samp_b", "s_samp_j", "s_valid", "s_pos",
                                   "S", "max_len", "window", "min_n"])
    def _ngram_propose_kernel(store_ptr, length_ptr, slots_ptr, sampled_ptr, valid_ptr, pos_ptr,
                              out_ptr, s_store, s_slots, s_samp_b, s_samp_j, s_valid, s_pos,
                              S, max_len, window, min_n,
                              M: tl.constexpr, K: tl.constexpr, S_BLOCK: tl.constexpr,
                              K_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        # (Masks combine vectors with vectors only: Triton 3.9's interpreter types a scalar bool
        # & a vector bool as int64, which tl.load rejects as a mask.)
        b = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + b * s_slots).to(tl.int64)
        a = tl.load(valid_ptr + b * s_valid).to(tl.int64)
        nxt = tl.load(pos_ptr + b * s_pos).to(tl.int64)
        row = store_ptr + slot * s_store                 # the slot's history row (int64 tokens)
        active = a > 0

        # 1. append: sampled token j < a lands at nxt - a + 1 + j (if it fits the row)
        j = tl.arange(0, S_BLOCK)
        p = nxt - a + 1 + j
        put = (j < a) & (j < S) & (p >= 0) & (p < max_len)
        tok = tl.load(sampled_ptr + b * s_samp_b + j * s_samp_j, mask=put, other=-1)
        tl.store(row + p, tok.to(tl.int64), mask=put)
        L = tl.where(active, tl.minimum(nxt + 1, max_len), tl.load(length_ptr + slot).to(tl.int64))
        tl.store(length_ptr + slot, L, mask=active)
        tl.debug_barrier()                               # the search below reads those stores

        # 2. search: candidate occurrence ends v in [1, vmax], nearest block first
        ncap = tl.minimum(L - 1, M)                      # the longest n a match can have
        vmax = tl.where(active & (ncap >= min_n), tl.minimum(L, window - 1), 0)
        full = (ncap - 1) * window                       # best > full <=> best has n == ncap
        best = tl.full((), -1, tl.int64)                 # max of n * window - v (-1: none)
        v0 = tl.full((), 1, tl.int64)
        while (v0 <= vmax) & (best <= full):
            v = v0 + tl.arange(0, BLOCK)
            inb = v <= vmax
            alive = inb
            run = tl.zeros((BLOCK,), dtype=tl.int64)
            for t in tl.static_range(M):
                gp = L - 1 - t                           # the n-gram's t-th last token
                g = tl.load(row + gp, mask=gp >= 0, other=-1)
                q = gp - v                               # the candidate's t-th last token
                inw = (v + t) < window
                # not masked by alive: the m loads of a block are independent (no serial chain)
                x = tl.load(row + q, mask=inb & inw & (q >= 0), other=-1)
                alive = alive & inw & (x == g)
                run += alive.to(tl.int64)
            n = tl.minimum(run, L - 1)                   # the n-gram must be real tokens
            score = tl.where(inb & (n >= min_n), n * window - v, -1)
            best = tl.maximum(best, tl.max(score, axis=0))
            v0 += BLOCK

        # 3. the K tokens after the best occurrence (it ends vb tokens back), copied with period vb
        #    (an overlapping copy: past L the continuation repeats itself)
        vb = (best // window + 1) * window - best         # = v where best = n * window - v >= 0
        first = tl.where(best >= 0, L - vb, L)           # no match: nothing before L to propose
        k = tl.arange(0, K_BLOCK)
        pk = first + k % vb
        ok = (k < K) & (pk < L)
        d = tl.load(row + pk, mask=ok, other=-1)
        tl.store(out_ptr + b * K + k, d.to(tl.int64), mask=k < K)


    # the step path's launch: FastLaunch skips JITFunction.run's per-call argument binding
    _launch = triton_common.FastLaunch(_ngram_propose_kernel)


class NgramTritonKernel:
    """``(store, length, slots, sampled, num_valid, input_pos) -> drafts [B, K]`` for one drafter's
    fixed sizes (computed once here, so a call is one allocation plus one launch).

    store [num_slots, >= max_len + 1] int64 (column max_len and on are never read or written),
    length [num_slots] int64; slots / num_valid / input_pos [B] and sampled [B, S] of any integer
    dtype and strides. ``block``: candidate occurrence ends per loop iteration (a power of two)."""

    def __init__(self, num_spec: int, min_n: int, m: int, max_len: int, window: int,
                 block: int | None = None, num_warps: int = 4):
        if not triton_available():
            raise RuntimeError("the Triton n-gram kernel needs Triton")
        if block is None:
            block = min(1024, max(16, next_pow2(window - 1)))
        if block < 1 or block & (block - 1):
            raise ValueError(f"block must be a power of two, got {block}")
        self.num_spec, self.min_n, self.m = num_spec, min_n, m
        self.max_len, self.window, self.block, self.num_warps = max_len, window, block, num_warps
        self._k_block = next_pow2(num_spec)

    def __call__(self, store: torch.Tensor, length: torch.Tensor, slots: torch.Tensor,
                 sampled: torch.Tensor, num_valid: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        B, S = sampled.shape
        out = torch.empty((B, self.num_spec), dtype=torch.int64, device=store.device)
        if B == 0:
            return out
        with device_ctx(store):
            _launch(
                (B,), store, length, slots, sampled, num_valid, input_pos, out,
                store.stride(0), slots.stride(0), sampled.stride(0), sampled.stride(1),
                num_valid.stride(0), input_pos.stride(0), S, self.max_len, self.window, self.min_n,
                M=self.m, K=self.num_spec, S_BLOCK=next_pow2(S), K_BLOCK=self._k_block,
                BLOCK=self.block, num_warps=self.num_warps)
        return out
