"""Paged KV cache: allocator, KVCache, write_kv, paged attention vs a plain per-row reference."""
import logging
import math

import pytest
import torch

from hybrid_engine.attention import (NULL_BLOCK, BlockAllocator, KVCache, NoFreeBlocks,
                                     blocks_needed, paged_attention, paged_attention_ref, write_kv)
from hybrid_engine.attention import ops as attn_ops

# ---------------------------------------------------------------- allocator / sizing


def test_blocks_needed():
    assert [blocks_needed(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    assert blocks_needed(9, 4) == 3
    with pytest.raises(ValueError):
        blocks_needed(1, 0)
    with pytest.raises(ValueError):
        blocks_needed(-1, 16)


def test_allocator_accounting_and_order():
    a = BlockAllocator(8)
    assert a.num_total == 7 and a.num_free == 7
    x = a.allocate(3)
    assert x == [1, 2, 3] and a.num_free == 4
    y = a.allocate(4)
    assert NULL_BLOCK not in x + y and sorted(x + y) == list(range(1, 8)) and a.num_free == 0
    assert a.allocate(0) == []
    a.free(x)
    assert a.num_free == 3
    assert a.allocate(3) == x          # LIFO: freed blocks come back in the order given
    a.free(x + y)
    assert a.num_free == a.num_total


def test_allocator_no_free_blocks_leaves_state():
    a = BlockAllocator(5)
    got = a.allocate(2)
    with pytest.raises(NoFreeBlocks):
        a.allocate(3)
    assert isinstance(NoFreeBlocks(), RuntimeError)
    assert a.num_free == 2
    rest = a.allocate(2)
    assert sorted(got + rest) == [1, 2, 3, 4]


def test_allocator_bad_frees():
    a = BlockAllocator(6)
    b = a.allocate(3)
    a.free([b[0]])
    with pytest.raises(ValueError):
        a.free([b[0]])                  # double free
    with pytest.raises(ValueError):
        a.free([0])                     # null block
    with pytest.raises(ValueError):
        a.free([6])                     # out of range
    with pytest.raises(ValueError):
        a.free([-1])
    with pytest.raises(ValueError):
        a.free([b[1], b[1]])            # duplicate within one call
    with pytest.raises(ValueError):
        a.free([b[1], b[0]])            # second one already free: nothing freed
    assert a.num_free == 3
    a.free(b[1:])
    assert a.num_free == a.num_total == 5
    with pytest.raises(ValueError):
        BlockAllocator(0)
    assert BlockAllocator(1).num_total == 0


def test_kv_cache_shapes_and_budget():
    c = KVCache(3, 10, 16, 2, 8, torch.bfloat16, "cpu")
    assert len(c.k) == len(c.v) == 3
    for t in c.k + c.v:
        assert t.shape == (10, 16, 2, 8) and t.dtype == torch.bfloat16 and not t.any()
    assert c.bytes == 2 * 3 * 10 * 16 * 2 * 8 * 2
    assert c.k[0].data_ptr() != c.k[1].data_ptr() != c.v[0].data_ptr()
    kw = dict(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    for budget in (0, 1, c.bytes - 1, c.bytes, c.bytes + 1, 10**6):
        n = KVCache.blocks_for_budget(budget, **kw)
        assert n * KVCache.bytes_per_block(**kw) <= budget < (n + 1) * KVCache.bytes_per_block(**kw)
    assert KVCache.blocks_for_budget(c.bytes, **kw) == 10


# ---------------------------------------------------------------- write_kv


def test_write_kv_round_trip():
    g = torch.Generator().manual_seed(0)
    N, bs, nkv, hd, T = 6, 4, 2, 8, 10
    kc = torch.zeros(N, bs, nkv, hd)
    vc = torch.zeros(N, bs, nkv, hd)
    slots = torch.randperm(N * bs, generator=g)[:T]
    k = torch.randn(T, nkv, hd, generator=g)
    v = torch.randn(T, nkv, hd, generator=g)
    write_kv(k, v, kc, vc, slots)
    blk, off = slots // bs, slots % bs
    torch.testing.assert_close(kc[blk, off], k, rtol=0, atol=0)
    torch.testing.assert_close(vc[blk, off], v, rtol=0, atol=0)
    untouched = torch.ones(N * bs, dtype=torch.bool)
    untouched[slots] = False
    assert not kc.view(-1, nkv, hd)[untouched].any() and not vc.view(-1, nkv, hd)[untouched].any()
    # dtype cast into a bf16 cache
    kb, vb = kc.bfloat16(), vc.bfloat16()
    write_kv(k, v, kb, vb, slots)
    torch.testing.assert_close(kb[blk, off], k.bfloat16(), rtol=0, atol=0)


# ---------------------------------------------------------------- paged attention


def build_case(rows, bs, nH, nkv, hd, dtype=torch.float32, poison=float("nan"), seed=0,
               extra_blocks=5, pad_tokens=0):
    """rows: list of (seq_len, q_len). Rows with seq_len 0 are padded rows (table -> block 0).

    Writes every row's K/V through write_kv into shuffled non-contiguous blocks of a cache whose
    other slots (null block included) hold ``poison``. Returns kwargs and the float64 originals.
    """
    g = torch.Generator().manual_seed(seed)
    need = [blocks_needed(s, bs) for s, _ in rows]
    M = max(need + [1]) + 1                                   # spare column stays 0
    N = 1 + sum(need) + extra_blocks
    kc = torch.full((N, bs, nkv, hd), poison, dtype=dtype)
    vc = torch.full((N, bs, nkv, hd), poison, dtype=dtype)
    perm = (torch.randperm(N - 1, generator=g) + 1).tolist()  # shuffled blocks 1..N-1
    bt = torch.zeros(len(rows), M, dtype=torch.int32)
    ks, vs, qs, qsl = [], [], [], [0]
    for b, (s, ql) in enumerate(rows):
        blocks = [perm.pop() for _ in range(need[b])]
        bt[b, :need[b]] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(s, nkv, hd, generator=g, dtype=torch.float64)
        v = torch.randn(s, nkv, hd, generator=g, dtype=torch.float64)
        pos = torch.arange(s)
        slots = torch.tensor(blocks, dtype=torch.long).repeat_interleave(bs)[:s] * bs + pos % bs
        write_kv(k.to(dtype), v.to(dtype), kc, vc, slots)
        ks.append(k.to(dtype).double())
        vs.append(v.to(dtype).double())
        qs.append(torch.randn(ql, nH, hd, generator=g, dtype=torch.float64))
        qsl.append(qsl[-1] + ql)
    q = torch.cat(qs + [torch.full((pad_tokens, nH, hd), poison, dtype=torch.float64)]).to(dtype)
    kw = dict(q=q, k_cache=kc, v_cache=vc, query_start_loc=torch.tensor(qsl, dtype=torch.int32),
              seq_lens=torch.tensor([s for s, _ in rows], dtype=torch.int32), block_tables=bt,
              scale=1.0 / math.sqrt(hd), max_query_len=max([ql for _, ql in rows] + [1]),
              max_seq_len=max([s for s, _ in rows] + [1]))
    return kw, ks, vs


def reference(kw, ks, vs, rows):
    """Plain per-row causal attention in float64 over contiguous K/V; zeros for padding tokens."""
    q = kw["q"].double()
    nH, nkv = q.shape[1], ks[0].shape[1] if ks else 1
    out = torch.zeros_like(q)
    qsl = kw["query_start_loc"].tolist()
    for b, (s, ql) in enumerate(rows):
        for i in range(ql):
            p = s - ql + i
            for h in range(nH):
                kh = h // (nH // nkv)
                sc = (ks[b][: p + 1, kh] @ q[qsl[b] + i, h]) * kw["scale"]
                out[qsl[b] + i, h] = torch.softmax(sc, 0) @ vs[b][: p + 1, kh]
    return out


MIXED = [(37, 37), (50, 13), (1, 1), (17, 3), (32, 9), (16, 16), (64, 1), (20, 4), (48, 2)]


@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("nH,nkv", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("poison", [float("nan"), 1e30, float("inf")])
def test_paged_attention_mixed_rows(bs, nH, nkv, poison):
    kw, ks, vs = build_case(MIXED, bs, nH, nkv, 16, poison=poison, seed=bs + nH + nkv)
    out = paged_attention_ref(**kw)
    assert out.shape == kw["q"].shape and out.dtype == kw["q"].dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(kw, ks, vs, MIXED), rtol=1e-4, atol=1e-5)


def test_padded_rows_and_tokens_harmless():
    # q_len 0 rows (seq_len 0, table -> null block) in the middle and at the end, a q_len-0 row
    # with context, and 3 graph-padding tokens past query_start_loc[-1] holding NaN.
    rows = [(5, 5), (0, 0), (33, 2), (12, 0), (0, 0), (16, 1), (0, 0)]
    kw, ks, vs = build_case(rows, 4, 4, 2, 8, pad_tokens=3, seed=3)
    assert (kw["block_tables"][1] == NULL_BLOCK).all()
    out = paged_attention_ref(**kw)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(kw, ks, vs, rows), rtol=1e-4, atol=1e-5)
    assert not out[-3:].any()
    # The same real rows alone give the same outputs: padding changes nothing.
    real = [r for r in rows if r[1] > 0]
    kw2, ks2, vs2 = build_case(real, 4, 4, 2, 8, seed=3)
    kw2["q"] = kw["q"][:-3]
    torch.testing.assert_close(paged_attention_ref(**kw2).double(),
                               reference(kw2, ks2, vs2, real), rtol=1e-4, atol=1e-5)


def test_upper_bounds_and_garbage_table_tail():
    rows = [(40, 7), (8, 8), (3, 1)]
    kw, ks, vs = build_case(rows, 16, 4, 2, 8, seed=5)
    exact = paged_attention_ref(**kw)
    kw["block_tables"][:, -1] = 10**6                     # unused column: never read
    kw["block_tables"][2, 1:] = -1
    loose = paged_attention_ref(**dict(kw, max_query_len=32, max_seq_len=10**4))
    torch.testing.assert_close(loose, exact, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(exact.double(), reference(kw, ks, vs, rows), rtol=1e-4, atol=1e-5)


def test_only_decode_rows_and_empty_batch():
    rows = [(s, 1 + s % 9) for s in (9, 16, 17, 31, 32, 64, 100)]
    kw, ks, vs = build_case(rows, 16, 4, 2, 8, seed=7)
    torch.testing.assert_close(paged_attention_ref(**kw).double(), reference(kw, ks, vs, rows),
                               rtol=1e-4, atol=1e-5)
    empty_qsl = torch.zeros(8, dtype=torch.int32)
    e = paged_attention_ref(**dict(kw, q=kw["q"][:0], query_start_loc=empty_qsl))
    assert e.shape == (0, 4, 8)


def test_bfloat16():
    kw, ks, vs = build_case(MIXED, 16, 4, 2, 32, dtype=torch.bfloat16, seed=11)
    out = paged_attention_ref(**kw)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(kw, ks, vs, MIXED), rtol=2e-2, atol=2e-2)


def test_no_host_reads():
    # On the meta device every value read (.item(), .tolist(), nonzero(), boolean indexing) fails.
    rows = [(37, 37), (50, 13), (0, 0), (17, 3)]
    kw, _, _ = build_case(rows, 16, 4, 2, 8, seed=1, pad_tokens=2)
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    out = paged_attention_ref(**meta)
    assert out.device.type == "meta" and out.shape == kw["q"].shape


def test_dispatcher_matches_ref_and_logs_once(caplog):
    kw, _, _ = build_case([(20, 5), (3, 1)], 4, 4, 2, 8, seed=2)
    attn_ops._logged_backends.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        a = paged_attention(**kw)
        b = paged_attention(**kw)
    torch.testing.assert_close(a, paged_attention_ref(**kw), rtol=0, atol=0)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    msgs = [r.getMessage() for r in caplog.records if "paged_attention backend" in r.getMessage()]
    assert len(msgs) == 1 and "torch_ref" in msgs[0]
