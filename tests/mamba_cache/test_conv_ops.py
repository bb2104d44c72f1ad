"""Conv ops (varlen prefill, multi-token update) vs the float64 oracles."""
import math

import pytest
import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
)
from oracles import F64, close, conv_seq64, qsl_of, tol_of


# ----------------------------------------------------------------------------- conv varlen

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("W,K", [(4, 0), (4, 3), (2, 1), (3, 8)])
def test_conv_varlen_vs_naive(dtype, seed, W, K):
    gen = torch.Generator().manual_seed(seed)
    Cd, S = 24, 10
    lens = [5, 1, 0, 2, 17, 1, 3][: 4 + seed]
    Bn = len(lens)
    T = sum(lens)
    x = torch.randn(T, Cd, generator=gen).to(dtype)
    weight = torch.randn(Cd, W, generator=gen).to(dtype)
    bias = torch.randn(Cd, generator=gen).to(dtype) if seed != 1 else None
    pool = torch.full((S, Cd, W - 1 + K), math.nan, dtype=dtype)
    slots = torch.randperm(S - 1, generator=gen)[:Bn] + 1
    slots[1] = NULL_SLOT                                     # a padded row
    pool[slots] = torch.randn(Bn, Cd, W - 1 + K, generator=gen).to(dtype)
    pool[NULL_SLOT] = math.nan
    has_init = torch.rand(Bn, generator=gen) < 0.5
    has_init[0] = True
    before = pool.clone()

    qsl = qsl_of(lens, torch.int32 if seed % 2 else torch.int64)
    out = causal_conv1d_varlen(x, weight, bias, pool, qsl, slots.to(torch.int32), has_init)
    assert out.dtype == dtype and out.shape == (T, Cd)

    starts = qsl.tolist()
    for b in range(Bn):
        s0, s1 = starts[b], starts[b + 1]
        if slots[b] == NULL_SLOT:
            continue
        win = before[slots[b], :, : W - 1] if has_init[b] else torch.zeros(Cd, W - 1)
        ref, xs = conv_seq64(win, x[s0:s1], weight, bias)
        close(out[s0:s1], ref, tol_of(dtype))
        torch.testing.assert_close(pool[slots[b], :, : W - 1].to(F64), xs[:, xs.shape[1] - (W - 1):],
                                   rtol=0, atol=0)
        # spec columns beyond W-1 untouched
        torch.testing.assert_close(pool[slots[b], :, W - 1:], before[slots[b], :, W - 1:],
                                   equal_nan=True, rtol=0, atol=0)
    used = set(slots.tolist())
    for s in range(S):                                      # unused and null slots untouched (NaN)
        if s not in used or s == NULL_SLOT:
            torch.testing.assert_close(pool[s], before[s], equal_nan=True, rtol=0, atol=0)


def test_conv_varlen_padding_tokens_ignored():
    """Tokens past query_start_loc[B] do not disturb real rows."""
    gen = torch.Generator().manual_seed(5)
    Cd, W = 8, 4
    x = torch.randn(9, Cd, generator=gen)
    x[7:] = math.nan
    weight, bias = torch.randn(Cd, W, generator=gen), torch.randn(Cd, generator=gen)
    pool = torch.randn(3, Cd, W - 1, generator=gen)
    ref_pool = pool.clone()
    qsl = torch.tensor([0, 3, 7])
    slots = torch.tensor([1, 2])
    has = torch.tensor([True, False])
    out = causal_conv1d_varlen(x, weight, bias, pool, qsl, slots, has)
    out_ref = causal_conv1d_varlen(x[:7].clone(), weight, bias, ref_pool, qsl, slots, has)
    torch.testing.assert_close(out[:7], out_ref)
    torch.testing.assert_close(pool, ref_pool)


# ----------------------------------------------------------------------------- conv update

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [0, 1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_conv_update_vs_naive(dtype, K, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    Cd, W, S, Nr = 16, 4, 9, 5
    for s in sorted({1, K + 1, max(1, K // 2 + 1)}):
        x = torch.randn(Nr, s, Cd, generator=gen).to(dtype)
        weight = torch.randn(Cd, W, generator=gen).to(dtype)
        bias = torch.randn(Cd, generator=gen).to(dtype)
        pool = torch.full((S, Cd, W - 1 + K), math.nan, dtype=dtype)
        slots = torch.randperm(S - 1, generator=gen)[:Nr] + 1
        slots[2] = NULL_SLOT
        pool[slots] = torch.randn(Nr, Cd, W - 1 + K, generator=gen).to(dtype)
        pool[NULL_SLOT] = math.nan
        acc = torch.randint(1, K + 2, (Nr,), generator=gen)
        before = pool.clone()
        out = causal_conv1d_update(x, weight, bias, pool, slots.to(torch.int32), acc.to(torch.int32))
        assert out.dtype == dtype and out.shape == (Nr, s, Cd)
        for r in range(Nr):
            if slots[r] == NULL_SLOT:
                continue
            off = int(acc[r]) - 1
            win = before[slots[r], :, off: off + W - 1]
            ref, xs = conv_seq64(win, x[r], weight, bias)
            close(out[r], ref, tol_of(dtype))
            nw = W - 2 + s
            torch.testing.assert_close(pool[slots[r], :, :nw].to(F64), xs[:, 1:], rtol=0, atol=0)
            torch.testing.assert_close(pool[slots[r], :, nw:], before[slots[r], :, nw:],
                                       equal_nan=True, rtol=0, atol=0)
        used = set(slots.tolist())
        for sl in range(S):
            if sl not in used or sl == NULL_SLOT:
                torch.testing.assert_close(pool[sl], before[sl], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("a", [1, 2, 3])
def test_conv_lazy_shift_example(a):
    """W=4, K=2: after a verify step of 3 tokens with `a` accepted, the next step reading at offset
    a-1 equals a from-scratch conv over the accepted prefix."""
    gen = torch.Generator().manual_seed(7)
    Cd, W, K = 6, 4, 2
    weight, bias = torch.randn(Cd, W, generator=gen), torch.randn(Cd, generator=gen)
    hist = torch.randn(5, Cd, generator=gen)                 # prefilled tokens
    pool = torch.full((2, Cd, W - 1 + K), math.nan)
    slot = torch.tensor([1])
    causal_conv1d_varlen(hist, weight, bias, pool, torch.tensor([0, 5]), slot, torch.tensor([False]))
    v = torch.randn(1, 3, Cd, generator=gen)                 # bonus + 2 drafts
    causal_conv1d_update(v, weight, bias, pool, slot, torch.tensor([1]))
    torch.testing.assert_close(pool[1].T, torch.cat([hist[-2:], v[0]]))   # [h2, h3, x0, x1, x2]
    nxt = torch.randn(1, 1, Cd, generator=gen)
    out = causal_conv1d_update(nxt, weight, bias, pool, slot, torch.tensor([a]))
    seq = torch.cat([hist, v[0, :a], nxt[0]])
    ref, _ = conv_seq64(torch.zeros(Cd, W - 1), seq, weight, bias)
    close(out[0, 0], ref[-1], 1e-5)
    torch.testing.assert_close(pool[1, :, : W - 1].T, seq[-(W - 1):])
