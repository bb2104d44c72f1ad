"""Paged KV cache and attention ops (see CONTRACT.md)."""
from .block_pool import NULL_BLOCK, BlockAllocator, NoFreeBlocks, blocks_needed
from .kv_cache import KVCache
from .ops import paged_attention, paged_attention_ref, write_kv

__all__ = [
    "NULL_BLOCK", "BlockAllocator", "NoFreeBlocks", "blocks_needed", "KVCache",
    "paged_attention", "paged_attention_ref", "write_kv",
]
