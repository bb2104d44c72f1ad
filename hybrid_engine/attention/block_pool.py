"""Block allocator for the paged KV cache.

Block 0 is the null block (``NULL_BLOCK``): never handed out; padded rows' block tables and padded
tokens' slot mappings point into it. Blocks 1..num_blocks-1 are allocatable.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK = 0


class NoFreeBlocks(RuntimeError):
    """Fewer free blocks than requested; nothing was allocated."""


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks to hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


class BlockAllocator:
    """LIFO free list over blocks 1..num_blocks-1 (deterministic: a fresh pool hands out 1, 2, ...).

    ``num_total`` counts allocatable blocks (num_blocks - 1, the null block excluded), so a drained
    pool has ``num_free == num_total``.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(
                f"num_blocks must be >= 1 (block 0 is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # pop() from the end -> 1 first
        self._is_free = [False] + [True] * (num_blocks - 1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_total(self) -> int:
        return self.num_blocks - 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks; raises NoFreeBlocks (state unchanged) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocks(f"requested {n} blocks, only {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._is_free[b] = False
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return blocks to the pool. Validates all first: on ValueError nothing is freed."""
        blocks = list(blocks)
        seen: set[int] = set()
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool):
                raise ValueError(f"block ids must be ints, got {b!r}")
            if b == NULL_BLOCK:
                raise ValueError("cannot free the null block 0")
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block {b} out of range [1, {self.num_blocks - 1}]")
            if self._is_free[b] or b in seen:
                raise ValueError(f"double free of block {b}")
            seen.add(b)
        # Push in reverse so that the next allocate() returns them in the order given.
        for b in reversed(blocks):
            self._is_free[b] = True
            self._free.append(b)


class CachingBlockAllocator(BlockAllocator):
    """The block pool with prefix caching: reference counts, a hash -> block map of full computed
    blocks, and an LRU list of cached blocks nobody references (evicted, oldest first, only when
    the free list is empty).

    Block states: *free* (on the free list, no hash), *referenced* (ref > 0; hashed or not),
    *cached* (ref == 0, hashed, on the LRU list). ``num_free`` counts free + cached blocks: both
    can be handed out, so the scheduler's capacity checks are unchanged. A block is never written
    while another request references it: sharing stops at a hashed (full, computed) block and
    writes start at the first unshared position (docs/design.md, "Prefix caching").
    ``on_evict(hash)`` is called when a cached block's hash is dropped (the checkpoint keyed by it
    becomes unreachable).
    """

    def __init__(self, num_blocks: int, on_evict=None):
        super().__init__(num_blocks)
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()   # cached, unreferenced; oldest first
        self.on_evict = on_evict
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks holding a hash (referenced or not)."""
        return len(self._by_hash)

    @property
    def num_referenced(self) -> int:
        return self.num_total - self.num_free

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > self.num_free:
            raise NoFreeBlocks(f"requested {n} blocks, only {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
                self._is_free[b] = False
            else:                                   # evict the least recently used cached block
                b, _ = self._lru.popitem(last=False)
                self._drop_hash(b)
                self.num_evictions += 1
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference per block. Unhashed blocks return to the free list, hashed ones to
        the LRU list (the last block of a request first, so a sequence's tail is evicted before
        its head). Validates all first: on ValueError nothing changes."""
        blocks = list(blocks)
        drops: dict[int, int] = {}
        for b in blocks:
            if not isinstance(b, int) or isinstance(b, bool):
                raise ValueError(f"block ids must be ints, got {b!r}")
            if b == NULL_BLOCK:
                raise ValueError("cannot free the null block 0")
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block {b} out of range [1, {self.num_blocks - 1}]")
            drops[b] = drops.get(b, 0) + 1
            if drops[b] > self._ref[b]:
                raise ValueError(f"double free of block {b}")
        unhashed = []
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b]:
                continue
            if self._hash[b] is not None:
                self._lru[b] = None
            else:
                unhashed.append(b)
        for b in unhashed:                          # LIFO: the next allocate() returns them in order
            self._is_free[b] = True
            self._free.append(b)

    # ---- prefix caching ------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The blocks of the longest prefix of ``hashes`` that is cached (no references taken)."""
        out = list(map(self._by_hash.get, hashes))          # C-level loops: ~130 blocks a 2k prompt
        if None in out:
            del out[out.index(None):]
        return out

    def num_unreferenced(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit on the LRU list (taking them shrinks ``num_free``)."""
        return list(map(self._ref.__getitem__, blocks)).count(0)

    def take(self, blocks: Iterable[int]) -> None:
        """One more reference on each (cached) block: a request shares it."""
        ref, lru = self._ref, self._lru
        blocks = list(blocks)
        if None in map(self._hash.__getitem__, blocks):
            b = next(b for b in blocks if self._hash[b] is None)
            raise ValueError(f"block {b} is not a cached block")
        for b in blocks:
            if not ref[b]:
                del lru[b]
            ref[b] += 1

    def register(self, block: int, block_hash: bytes) -> bool:
        """Record that referenced ``block`` holds the computed KV of ``block_hash``. False (nothing
        changes) when the block already has a hash or another block already holds this one (the
        duplicate stays private and returns to the free list when freed)."""
        if self._ref[block] == 0:
            raise ValueError(f"block {block} is not referenced; only a live block can be registered")
        if self._hash[block] is not None or block_hash in self._by_hash:
            return False
        self._hash[block] = block_hash
        self._by_hash[block_hash] = block
        return True

    def _drop_hash(self, b: int) -> None:
        h = self._hash[b]
        self._hash[b] = None
        del self._by_hash[h]
        if self.on_evict is not None:
            self.on_evict(h)

    def reset_cache(self) -> None:
        """Forget every cached, unreferenced block (they return to the free list)."""
        while self._lru:
            b, _ = self._lru.popitem(last=False)
            self._drop_hash(b)
            self._is_free[b] = True
            self._free.append(b)
