"""Prefix caching's host bookkeeping: the refcounted block pool with its hash map and LRU list
(CachingBlockAllocator), the Mamba checkpoint index (CheckpointIndex) and the hash chain
(docs/design.md, "Prefix caching", invariants 13 and 14)."""
import random

import numpy as np
import pytest

from hybrid_engine.attention.block_pool import CachingBlockAllocator, NoFreeBlocks
from hybrid_engine.mamba_cache.checkpoints import CheckpointIndex
from hybrid_engine.scheduling.prefix_cache import RecentChains, hash_blocks


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


@pytest.mark.parametrize("bs, lookahead", [(4, 0), (4, 1), (16, 1), (3, 2)])
def test_recent_chains_equal_hashing_from_scratch(bs, lookahead):
    """Prompts sharing prefixes of every length with recent ones (a block boundary, one token
    before or after it, inside the lookahead, none at all, one prompt a prefix of another): each
    chain equals hash_blocks from scratch, and the shared blocks were reused, not rehashed."""
    rng = np.random.default_rng(bs * 10 + lookahead)
    rc = RecentChains(bs, lookahead, size=3)
    base = rng.integers(0, 50, 120).tolist()
    for it in range(150):
        cut = int(rng.integers(0, 121))
        tail = rng.integers(0, 3, int(rng.integers(0, 30))).tolist()      # 0..2: often equal to base by chance
        tokens = base[:cut] + tail if rng.random() < 0.85 else rng.integers(0, 3, int(rng.integers(0, 40))).tolist()
        assert rc.chain(tokens) == hash_blocks(tokens, bs, lookahead), it
    assert rc.reused_blocks > 150 * 2, rc.reused_blocks
    full = base + [7] * (2 * bs)
    rc.chain(full)
    before = rc.reused_blocks
    assert rc.chain(full[:len(full) - 1]) == hash_blocks(full[:len(full) - 1], bs, lookahead)
    assert rc.reused_blocks - before == len(hash_blocks(full[:len(full) - 1], bs, lookahead))   # all reused
    arr = np.array(full, dtype=np.int64)                    # a caller's array, changed after hashing
    rc.chain(arr)
    arr[:] = 1
    assert rc.chain(arr) == hash_blocks(arr.tolist(), bs, lookahead)


def test_take_refuses_an_uncached_block_without_changing_the_pool():
    p = CachingBlockAllocator(8)
    a = p.allocate(3)
    p.register(a[0], b"h0")
    p.register(a[1], b"h1")
    p.free(a)                                              # a[0], a[1] cached, unreferenced; a[2] free
    before = ([p.ref_count(b) for b in range(8)], p.num_free, p.num_unreferenced(a[:2]))
    with pytest.raises(ValueError, match="not a cached block"):
        p.take([a[0], a[1], a[2]])
    assert ([p.ref_count(b) for b in range(8)], p.num_free, p.num_unreferenced(a[:2])) == before


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
    end or branch point, least recently used first; a second continuation makes it a branch point;
    when its one continuation is forgotten it is a chain end again; pins and drops keep working on
    both lists."""
    ix = CheckpointIndex(4)
    rows = {}

    def save(h):
        rows[h] = ix.allocate()
        ix.commit(rows[h], h)
    for h in (b"sys", b"a1", b"a2", b"b1"):
        save(h)
    ix.continued(b"sys", b"a1")                   # one conversation went on from the system prompt
    ix.continued(b"a1", b"a2")                    # its next turn went on from a1
    ix.continued(b"a2", b"a3")                    # a3 is not cached (evicted before the commit): ignored
    assert ix.num_straight == 2
    ix.continued(b"sys", b"b1")                   # a second conversation: sys is a branch point
    ix.continued(b"sys", b"a1")                   # (the same continuation again changes nothing)
    assert ix.num_straight == 1
    ix.touch(rows[b"a1"])                         # recently used, but on a straight chain
    assert ix.allocate() == rows[b"a1"] and ix.get(b"a1") is None
    ix.commit(rows[b"a1"], b"a1")                 # saved again: a chain end now
    assert ix.num_straight == 0
    ix.pin(rows[b"a1"])                           # pinned by a restore: never evicted
    ix.continued(b"a1", b"a2")                    # continued while pinned: placed when unpinned
    ix.unpin(rows[b"a1"])
    assert ix.num_straight == 1
    ix.drop(b"a2")                                # a2's KV block was evicted: a1 is a chain end again
    assert ix.num_straight == 0 and ix.get(b"a2") is None
    save(b"c1")                                   # the freed row
    assert rows[b"c1"] == rows[b"a2"]
    # then plain LRU over chain ends and branch points: b1 (sys was continued, i.e. used, after
    # b1's save), sys, a1, c1
    assert [ix.allocate() for _ in range(4)] == [rows[h] for h in (b"b1", b"sys", b"a1", b"c1")]
    assert ix.num_pinned == 4 and ix.allocate() is None


def test_random_checkpoint_index_ops_keep_every_row_on_its_one_list():
    """Random legal operation sequences, as PrefixCache drives the index (commit or discard only
    rows handed out and not yet published, pin only cached rows, unpin only what was pinned), some
    with chain-shaped continuations: after every operation each cached unpinned row is on exactly
    the eviction list its continuations say, free and pinned rows on none, the counts agree, and
    allocate never hands out a pinned row."""
    for seed in range(60):
        _random_index_ops(seed, steps=1500, mode=0)
        _random_index_ops(seed, steps=1500, mode=1)


def _check_index(ix: CheckpointIndex, saves: set, restores: dict):
    R = ix.num_rows
    free = ix._free
    assert len(free) == len(set(free)), f"duplicate in _free {free}"
    lru, st = set(ix._lru), set(ix._straight)
    assert not (lru & st), f"row on both lists {lru & st}"
    used = 0
    for r in range(R):
        h, p, nxt = ix._hash[r], ix._pins[r], ix._next[r]
        assert len(nxt) <= 2
        if h is None:
            assert not nxt, f"hashless row {r} keeps _next {nxt}"
        if p > 0:
            assert r not in lru and r not in st and r not in free, f"pinned row {r} on a list / free"
            used += 1
            # pins accounted for: a save in flight (hashless) or restores
            assert p == (1 if r in saves else 0) + restores.get(r, 0), (r, p, saves, restores)
        elif h is not None:
            on = (r in lru) + (r in st)
            assert on == 1, f"cached row {r} on {on} lists"
            assert r not in free
            want_straight = len(nxt) == 1
            assert (r in st) == want_straight, f"row {r} on the wrong list (next={nxt})"
            # a straight row's one continuation is still cached (else it is a chain end again)
            assert not want_straight or next(iter(nxt)) in ix._by_hash, (r, nxt)
            assert ix._by_hash.get(h) == r
            used += 1
        else:
            assert r in free, f"free row {r} (hash None, pins 0) not on _free"
            assert r not in lru and r not in st
    assert ix.num_used == used == R - len(free), (ix.num_used, used, R, len(free))
    for h, r in ix._by_hash.items():
        assert ix._hash[r] == h
    assert ix.num_straight == len(st)



def _random_index_ops(seed: int, steps: int = 3000, mode: int = 0):
    rng = random.Random(seed)
    R = rng.randint(1, 8 if mode == 0 else 10)
    ix = CheckpointIndex(R)
    hashes = [bytes([i]) for i in range(rng.randint(3, 14) if mode == 0 else rng.randint(10, 60))]
    saves: set[int] = set()           # rows allocated, not yet committed / discarded
    restores: dict[int, int] = {}     # row -> restore pins held by this test
    for _ in range(steps):
        op = rng.choice(["allocate", "allocate", "commit", "commit", "discard", "pin", "unpin",
                         "touch", "drop", "continued", "continued", "continued"] if mode == 0 else
                        ["allocate"] * 3 + ["commit"] * 3 + ["discard", "pin", "unpin", "touch", "drop",
                                                             "chain", "chain", "continued"])
        if op == "allocate":
            before = list(ix._pins)
            r = ix.allocate()
            if r is None:
                assert all(p > 0 for p in before), "allocate refused with an unpinned row"
            else:
                assert before[r] == 0, f"allocate handed out pinned row {r}"
                assert ix._hash[r] is None and not ix._next[r]
                saves.add(r)
        elif op in ("commit", "discard") and saves:
            r = rng.choice(sorted(saves))
            saves.discard(r)
            if op == "commit":
                ix.commit(r, rng.choice(hashes))
            else:
                ix.discard(r)
        elif op == "pin":
            cached = [r for r in range(R) if ix._hash[r] is not None]
            if cached:
                r = rng.choice(cached)
                ix.pin(r)
                restores[r] = restores.get(r, 0) + 1
        elif op == "unpin" and restores:
            r = rng.choice(sorted(restores))
            ix.unpin(r)
            restores[r] -= 1
            if not restores[r]:
                del restores[r]
        elif op == "touch":
            ix.touch(rng.randrange(R))
        elif op == "drop":
            ix.drop(rng.choice(hashes))
        elif op == "chain":                       # chain-shaped continuations: straight rows
            i = rng.randrange(len(hashes) - 1)
            ix.continued(hashes[i], hashes[i + 1])
        elif op == "continued":
            ix.continued(rng.choice(hashes), rng.choice(hashes))
        _check_index(ix, saves, restores)
