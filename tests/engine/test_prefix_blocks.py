"""Prefix caching's host bookkeeping: the refcounted block pool with its hash map and LRU list
(CachingBlockAllocator), the Mamba checkpoint index (CheckpointIndex) and the hash chain
(docs/design.md, "Prefix caching", invariants 13 and 14)."""
import numpy as np
import pytest

from hybrid_engine.attention.block_pool import CachingBlockAllocator, NoFreeBlocks
from hybrid_engine.mamba_cache.checkpoints import CheckpointIndex
from hybrid_engine.scheduling.prefix_cache import hash_blocks


def test_hash_chain_names_prefix_and_position():
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 0)
    assert len(a) == 2                                     # the partial block has no hash
    assert hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, 0) == a
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4, 0)         # same second block, other first block
    assert b[0] != a[0] and b[1] != a[1]
    c = hash_blocks([5, 6, 7, 8, 1, 2, 3, 4], 4, 0)         # same blocks, other positions
    assert set(c).isdisjoint(a)
    # lookahead: a block's hash covers the next token too, and needs it
    assert len(hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4, 1)) == 1
    assert hash_blocks([1, 2, 3, 4, 5], 4, 1) != hash_blocks([1, 2, 3, 4, 6], 4, 1)
    # incremental extension equals hashing at once
    toks = list(range(3, 40))
    full = hash_blocks(toks, 4, 1)
    assert full[:3] + hash_blocks(toks, 4, 1, parent=full[2], start_block=3) == full


def test_refcounts_share_and_return():
    p = CachingBlockAllocator(8)
    a = p.allocate(3)
    assert [p.ref_count(b) for b in a] == [1, 1, 1]
    for b, h in zip(a, (b"h0", b"h1", b"h2")):
        assert p.register(b, h)
    assert p.lookup([b"h0", b"h1", b"hx", b"h2"]) == a[:2]
    p.take(a[:2])                                          # a second request shares two blocks
    assert [p.ref_count(b) for b in a] == [2, 2, 1]
    p.free(a)
    assert [p.ref_count(b) for b in a] == [1, 1, 0]
    assert p.num_free == 5 and p.num_referenced == 2       # the cached block counts as free
    p.free(a[:2])
    assert p.num_referenced == 0 and p.num_free == 7 and p.num_cached == 3
    with pytest.raises(ValueError, match="double free"):
        p.free([a[0]])
    # a cached block is taken back out of the LRU list by a hit
    p.take(a[:1])
    assert p.num_free == 6 and p.ref_count(a[0]) == 1
    p.free(a[:1])


def test_lru_evicts_oldest_unreferenced_and_never_a_referenced_block():
    evicted = []
    p = CachingBlockAllocator(5, on_evict=evicted.append)   # blocks 1..4
    x = p.allocate(2)
    y = p.allocate(2)
    for b, h in zip(x + y, (b"x0", b"x1", b"y0", b"y1")):
        p.register(b, h)
    p.free(x)                                              # x's tail first on the LRU list, then its head
    p.free(y)
    got = p.allocate(1)
    assert got == [x[1]] and evicted == [b"x1"]           # the oldest, the tail of x
    p.take([y[0]])
    got = p.allocate(2)                                    # y[0] is referenced: never handed out
    assert y[0] not in got and set(got) == {x[0], y[1]}
    with pytest.raises(NoFreeBlocks):
        p.allocate(1)
    assert p.lookup([b"y0"]) == [y[0]] and p.lookup([b"x0"]) == []


def test_register_keeps_the_first_block_of_a_hash():
    p = CachingBlockAllocator(4)
    a, b = p.allocate(2)
    assert p.register(a, b"h") and not p.register(b, b"h") and not p.register(a, b"g")
    p.free([a, b])
    assert p.num_cached == 1 and p.lookup([b"h"]) == [a]
    with pytest.raises(ValueError, match="not referenced"):
        p.register(b, b"g")


def test_random_ops_never_hand_out_a_referenced_block():
    """Random allocate / take / register / free: an allocated block always had no reference,
    reference counts equal the test's own count, and everything returns at the end."""
    rng = np.random.default_rng(5)
    p = CachingBlockAllocator(12)
    held: list[list[int]] = []                             # per simulated request: its block refs
    refs = {}
    for step in range(2000):
        op = rng.integers(4)
        if op == 0 and p.num_free:
            n = int(rng.integers(1, p.num_free + 1))
            got = p.allocate(n)
            for b in got:
                assert refs.get(b, 0) == 0
                refs[b] = 1
            held.append(got)
        elif op == 1 and held:
            blocks = held[int(rng.integers(len(held)))]
            b = blocks[int(rng.integers(len(blocks)))]
            p.register(b, bytes([int(rng.integers(6))]))
        elif op == 2 and held:
            hs = [bytes([int(i)]) for i in rng.permutation(6)[:3]]
            hit = p.lookup(hs)
            if hit:
                p.take(hit)
                for b in hit:
                    refs[b] = refs.get(b, 0) + 1
                held.append(hit)
        elif op == 3 and held:
            blocks = held.pop(int(rng.integers(len(held))))
            p.free(blocks)
            for b in blocks:
                refs[b] -= 1
        for b in range(1, 12):
            assert p.ref_count(b) == refs.get(b, 0)
    for blocks in held:
        p.free(blocks)
    assert p.num_referenced == 0 and p.num_free == p.num_total


def test_checkpoint_index_pins_and_lru():
    ix = CheckpointIndex(2)
    r0, r1 = ix.allocate(), ix.allocate()
    assert ix.allocate() is None                           # both pinned by saves in flight
    ix.commit(r0, b"a")
    ix.discard(r1)                                         # its step failed
    assert ix.get(b"a") == r0 and ix.num_used == 1
    ix.pin(r0)                                             # a restore is scheduled
    r = ix.allocate()
    assert r == r1
    assert ix.allocate() is None                           # r0 pinned: never evicted
    ix.commit(r, b"b")
    ix.unpin(r0)                                           # a was used after b was saved
    assert ix.allocate() == r and ix.get(b"b") is None    # the least recently used row goes
    ix.commit(r, b"a")                                     # a duplicate of a: freed again
    assert ix.get(b"a") == r0 and ix.num_used == 1 and ix.num_pinned == 0
    ix.drop(b"a")                                          # its KV block was evicted
    assert ix.num_used == 0
    with pytest.raises(ValueError):
        ix.unpin(r0)


def test_checkpoints_on_a_straight_chain_are_evicted_first():
    """A checkpoint that requests continued to exactly one deeper checkpoint goes before any chain
    end or branch point, least recently used first; a second continuation makes it a branch point
    again; pins and drops keep working on both lists."""
    ix = CheckpointIndex(4)
    rows = {}
    for h in (b"sys", b"a1", b"a2", b"b1"):
        rows[h] = ix.allocate()
        ix.commit(rows[h], h)
    ix.continued(b"sys", b"a1")                   # one conversation went on from the system prompt
    ix.continued(b"a1", b"a2")                    # its next turn went on from a1
    assert ix.num_straight == 2
    ix.continued(b"sys", b"b1")                   # a second conversation: sys is a branch point
    ix.continued(b"sys", b"a1")                   # (the same continuation again changes nothing)
    assert ix.num_straight == 1
    ix.touch(rows[b"a1"])                         # recently used, but on a straight chain
    assert ix.allocate() == rows[b"a1"] and ix.get(b"a1") is None
    # then plain LRU over chain ends and branch points
    ix.pin(rows[b"a2"])                           # pinned by a restore: never evicted
    ix.continued(b"a2", b"a3")                    # continued while pinned: placed when unpinned
    ix.unpin(rows[b"a2"])
    assert ix.num_straight == 1
    ix.drop(b"a2")                                # its KV block was evicted
    assert ix.num_straight == 0 and ix.get(b"a2") is None
    assert ix.allocate() == rows[b"a2"]           # the freed row first
    assert ix.allocate() == rows[b"b1"]           # then the least recently used cached row (sys
    #                                               was continued, i.e. used, after b1's save)
    assert ix.allocate() == rows[b"sys"]
    assert ix.num_pinned == 4 and ix.allocate() is None
