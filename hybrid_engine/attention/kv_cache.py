"""Owner of the per-attention-layer paged K/V cache tensors."""
from __future__ import annotations

import torch


class KVCache:
    """k[i], v[i]: [num_blocks, block_size, num_kv_heads, head_dim] in ``dtype``, zero-filled.

    ``i`` indexes attention layers only (0..num_layers-1), not model layers.
    Block 0 is the null block.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        for name, val in (("num_layers", num_layers), ("block_size", block_size),
                          ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if val < 0 or (val == 0 and name != "num_layers"):
                raise ValueError(f"{name} must be > 0, got {val}")
        if num_blocks < 1:
            raise ValueError(
                f"num_blocks must be >= 1 (block 0 is the null block), got {num_blocks}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def bytes(self) -> int:
        """Total bytes of all k and v tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers, k and v."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    @classmethod
    def blocks_for_budget(cls, bytes_budget: int, num_layers: int, block_size: int,
                          num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Largest num_blocks (null block included) whose KVCache.bytes <= bytes_budget."""
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        if per_block <= 0:
            raise ValueError("no attention layers: KV cache size is independent of num_blocks")
        return max(0, int(bytes_budget) // per_block)

    def __repr__(self) -> str:
        return (f"KVCache(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
                f"bytes={self.bytes})")
