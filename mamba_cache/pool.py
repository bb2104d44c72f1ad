"""Mamba state pool: per Mamba layer, a conv window and 1+K SSM checkpoints per request slot.

Slot 0 is NULL_SLOT (padding); request slots are 1..max_num_seqs. The pool owns the tensors and the
free list; the ops in ``mamba_cache.ops`` read and write the tensors in place.
"""
from __future__ import annotations

import logging

import torch

from . import NULL_SLOT

logger = logging.getLogger("hybrid_engine")


class NoFreeSlots(RuntimeError):
    pass


class MambaPool:
    def __init__(self, num_layers: int, max_num_seqs: int, conv_dim: int, conv_kernel: int,
                 num_heads: int, head_dim: int, state_size: int, num_spec: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_slots = max_num_seqs + 1
        self.num_spec = num_spec
        width = conv_kernel - 1 + num_spec
        # conv_state[i]: [S, conv_dim, W-1+K] model dtype, a view of token-major storage
        # [S, W-1+K, conv_dim] (strides (W-1+K)*C, 1, C)): a window column of all channels is
        # contiguous, so the decode conv kernel's loads and stores are coalesced (the channel-major
        # layout made them 12-byte strided: 25% of copy bandwidth on an H100).  Every op takes
        # strides, so the logical [S, C, W-1+K] indexing is unchanged.
        # ssm_state[i]: [S, 1+K, H, P, N] float32
        # Each list holds views of one tensor over all layers (conv_all, ssm_all), so a per-slot
        # operation on every layer (a prefix-cache restore, a fork) is one op, not one per layer.
        self.conv_all = torch.zeros(num_layers, self.num_slots, width, conv_dim, dtype=dtype,
                                    device=device).transpose(2, 3)              # [L, S, C, W-1+K]
        self.ssm_all = torch.zeros(num_layers, self.num_slots, 1 + num_spec, num_heads, head_dim, state_size,
                                   dtype=torch.float32, device=device)          # [L, S, 1+K, H, P, N]
        self.conv_state = list(self.conv_all.unbind(0))
        self.ssm_state = list(self.ssm_all.unbind(0))
        logger.info("mamba pool: %d layers x %d slots (K=%d), %.1f MiB", num_layers, self.num_slots,
                    num_spec, self.bytes / 2**20)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_all, self.ssm_all))

    @staticmethod
    def bytes_for(num_layers: int, max_num_seqs: int, conv_dim: int, conv_kernel: int, num_heads: int,
                  head_dim: int, state_size: int, num_spec: int, dtype: torch.dtype) -> int:
        """What ``MambaPool(...)`` with these arguments allocates, without allocating it."""
        slots = max_num_seqs + 1
        conv = slots * (conv_kernel - 1 + num_spec) * conv_dim * torch.empty((), dtype=dtype).element_size()
        ssm = slots * (1 + num_spec) * num_heads * head_dim * state_size * 4
        return num_layers * (conv + ssm)


def check_pool_fits(pool_bytes: int, free_bytes: int, *, max_num_seqs: int, num_spec: int) -> None:
    """ValueError naming the settings when the pool cannot fit the device memory left for it
    (instead of an out-of-memory error from deep inside the engine's construction)."""
    if pool_bytes <= free_bytes:
        return
    raise ValueError(
        f"the Mamba state pool needs {pool_bytes / 2**30:.1f} GiB (max_num_seqs={max_num_seqs} request slots, "
        f"each with 1 + num_speculative_tokens = {1 + num_spec} SSM states per Mamba layer) but only "
        f"{free_bytes / 2**30:.1f} GiB of device memory are left after the weights and the KV cache; lower "
        f"max_num_seqs or num_speculative_tokens, or kv_cache_memory_fraction / num_kv_blocks")



class SlotAllocator:
    """Free list of request slots 1..num_slots-1 (CPU only; owned by the scheduler)."""

    def __init__(self, num_slots: int):
        self.num_total = num_slots - 1
        self._free = list(range(num_slots - 1, NULL_SLOT, -1))  # pop() hands out the lowest slot
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeSlots("no free Mamba state slot")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"invalid Mamba slot to free: {slot} (not allocated)")
        self._used.remove(slot)
        self._free.append(slot)
