"""Block allocator for the paged KV cache.

Block 0 is the null block (``NULL_BLOCK``): never handed out; padded rows' block tables and padded
tokens' slot mappings point into it. Blocks 1..num_blocks-1 are allocatable.
"""
from __future__ import annotations

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
