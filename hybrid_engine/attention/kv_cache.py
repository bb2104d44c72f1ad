"""Owner of the per-attention-layer paged K/V cache tensors (and, for an FP8 cache, their scales)."""
from __future__ import annotations

from typing import Sequence

import torch

# storage dtypes holding codes that are multiplied by a per-layer scale when read
FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_KV_MAX = 448.0                  # largest finite float8_e4m3fn; a stored x / scale is clamped to it


class KVCache:
    """k[i], v[i]: [num_blocks, block_size, num_kv_heads, head_dim] in ``dtype``, zero-filled.

    ``dtype`` is the storage dtype: the model dtype, or float8_e4m3fn. For FP8, ``k_scale[i]`` and
    ``v_scale[i]`` are [] float32 device tensors (value = code * scale; 1.0 until ``set_scales``),
    updated in place so CUDA graphs captured before keep reading them; else both are None.
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
        self.k_scale: list[torch.Tensor] | None = None
        self.v_scale: list[torch.Tensor] | None = None
        if self.quantized:
            one = lambda: torch.ones((), dtype=torch.float32, device=self.device)   # noqa: E731
            self.k_scale = [one() for _ in range(num_layers)]
            self.v_scale = [one() for _ in range(num_layers)]

    @property
    def quantized(self) -> bool:
        """True when k / v hold FP8 codes (read as code * scale)."""
        return self.dtype in FP8_KV_DTYPES

    def scales(self, i: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) of attention layer ``i``: [] float32 tensors, or (None, None) when
        the cache holds values in the model dtype."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[i], self.v_scale[i]

    def set_scales(self, k_scales: Sequence[float] | torch.Tensor,
                   v_scales: Sequence[float] | torch.Tensor) -> None:
        """Per-layer scales ([num_layers] each: positive, finite), copied into the existing
        tensors. Load time only (the check reads them on the host)."""
        if not self.quantized:
            raise ValueError(f"set_scales: this KV cache stores {self.dtype}, which has no scales")
        for name, vals in (("k_scales", k_scales), ("v_scales", v_scales)):
            t = torch.as_tensor(vals, dtype=torch.float32).detach().cpu().reshape(-1)
            if t.numel() != self.num_layers:
                raise ValueError(f"{name} needs {self.num_layers} values (one per attention layer), "
                                 f"got {t.numel()}")
            if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
                raise ValueError(f"{name} must be positive and finite, got {t.tolist()}")
            for dst, val in zip(self.k_scale if name == "k_scales" else self.v_scale, t):
                dst.fill_(float(val))

    @property
    def bytes(self) -> int:
        """Total bytes of all k and v tensors."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """Bytes one block costs across all layers, k and v, stored in ``dtype`` (the storage
        dtype: an FP8 cache costs half a 16-bit one)."""
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
