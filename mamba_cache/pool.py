"""Mamba state pool: per Mamba layer and request slot, a conv window and the SSM state: 1+K
checkpoints, or (``deferred``, a spec engine's target) one state and the pending inputs of the last
verify's other K tokens (CONTRACT item 4b).

Slot 0 is NULL_SLOT (padding); request slots are 1..max_num_seqs. The pool owns the tensors and the
free list; the ops in ``mamba_cache.ops`` read and write the tensors in place.
"""
from __future__ import annotations

import logging

import torch

from . import NULL_SLOT
from .ops.state_update import PendingInputs, pending_blocks

logger = logging.getLogger("hybrid_engine")


class NoFreeSlots(RuntimeError):
    pass


class MambaPool:
    def __init__(self, num_layers: int, max_num_seqs: int, conv_dim: int, conv_kernel: int,
                 num_heads: int, head_dim: int, state_size: int, num_spec: int,
                 dtype: torch.dtype, device: torch.device, deferred: bool = False):
        self.num_slots = max_num_seqs + 1
        self.num_spec = num_spec
        # deferred: one state a slot and the inputs to replay (the verify writes one state, not 1+K)
        self.deferred = deferred and num_spec > 0
        num_states = 1 if self.deferred else 1 + num_spec
        width = conv_kernel - 1 + num_spec
        # conv_state[i]: [S, conv_dim, W-1+K] model dtype, a view of token-major storage
        # [S, W-1+K, conv_dim] (strides (W-1+K)*C, 1, C)): a window column of all channels is
        # contiguous, so the decode conv kernel's loads and stores are coalesced (the channel-major
        # layout made them 12-byte strided: 25% of copy bandwidth on an H100).  Every op takes
        # strides, so the logical [S, C, W-1+K] indexing is unchanged.
        # ssm_state[i]: [S, 1+K, H, P, N] float32 ([S, 1, H, P, N] deferred)
        # pending[i]: PendingInputs (deferred) or None
        # Each list holds views of one tensor over all layers (conv_all, ssm_all, ...), so a per-slot
        # operation on every layer (a prefix-cache restore, a fork) is one op, not one per layer.
        self.conv_all = torch.zeros(num_layers, self.num_slots, width, conv_dim, dtype=dtype,
                                    device=device).transpose(2, 3)              # [L, S, C, W-1+K]
        self.ssm_all = torch.zeros(num_layers, self.num_slots, num_states, num_heads, head_dim, state_size,
                                   dtype=torch.float32, device=device)          # [L, S, 1+K or 1, H, P, N]
        self.conv_state = list(self.conv_all.unbind(0))
        self.ssm_state = list(self.ssm_all.unbind(0))
        # deferred: (x [L, S, K, H, P], dt [L, S, K, H, nb], B [L, S, K, H, nb, N]), else ()
        self.pending_all: tuple[torch.Tensor, ...] = ()
        self.pending: list[PendingInputs | None] = [None] * num_layers
        if self.deferred:
            nb = pending_blocks(head_dim, state_size)
            lead = (num_layers, self.num_slots, num_spec, num_heads)
            self.pending_all = (torch.zeros(*lead, head_dim, dtype=dtype, device=device),              # x
                                 torch.zeros(*lead, nb, dtype=dtype, device=device),                    # dt
                                 torch.zeros(*lead, nb, state_size, dtype=dtype, device=device))        # B
            self.pending = [PendingInputs(x=x, dt=dt, B=B) for x, dt, B in zip(*(t.unbind(0) for t in self.pending_all))]
        logger.info("mamba pool: %d layers x %d slots (K=%d%s), %.1f MiB", num_layers, self.num_slots,
                    num_spec, ", deferred state update" if self.deferred else "", self.bytes / 2**20)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_all, self.ssm_all, *self.pending_all))

    def copy_slot(self, dst_slot: int, src_slot: int) -> None:
        """Slot dst_slot := slot src_slot in every layer (conv window, SSM state, pending inputs):
        device-to-device copies launched with host ints, no sync (a fork, ``step/fork_state.py``)."""
        for t in (self.conv_all, self.ssm_all, *self.pending_all):
            t[:, dst_slot].copy_(t[:, src_slot])

    @staticmethod
    def bytes_for(num_layers: int, max_num_seqs: int, conv_dim: int, conv_kernel: int, num_heads: int,
                  head_dim: int, state_size: int, num_spec: int, dtype: torch.dtype, deferred: bool = False) -> int:
        """What ``MambaPool(...)`` with these arguments allocates, without allocating it."""
        slots = max_num_seqs + 1
        elt = torch.empty((), dtype=dtype).element_size()
        conv = slots * (conv_kernel - 1 + num_spec) * conv_dim * elt
        if deferred and num_spec:
            nb = pending_blocks(head_dim, state_size)
            ssm = slots * num_heads * head_dim * state_size * 4
            ssm += slots * num_spec * num_heads * (head_dim + nb + nb * state_size) * elt
        else:
            ssm = slots * (1 + num_spec) * num_heads * head_dim * state_size * 4
        return num_layers * (conv + ssm)


def check_pool_fits(pool_bytes: int, free_bytes: int, *, max_num_seqs: int, num_spec: int) -> None:
    """ValueError naming the settings when the pool cannot fit the device memory left for it
    (instead of an out-of-memory error from deep inside the engine's construction)."""
    if pool_bytes <= free_bytes:
        return
    raise ValueError(
        f"the Mamba state pool needs {pool_bytes / 2**30:.1f} GiB (max_num_seqs={max_num_seqs} request slots, "
        f"num_speculative_tokens={num_spec}) but only "
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
