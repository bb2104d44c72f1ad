"""Prefix-cache checkpoints of the Mamba state: the conv window and the SSM state after a block
boundary, stored in a pool of rows with its own memory budget (docs/design.md, "Prefix caching").

Two owners, one per side:

- ``CheckpointIndex`` (host, owned by the scheduler's ``PrefixCache``): which row holds the
  checkpoint of which block hash, pins (rows being written by a step in flight or read by a
  restore about to be launched), and the eviction order of the unpinned cached rows. No device work.
- ``MambaCheckpoints`` (device, in ``Caches``): per Mamba layer ``conv [R, C, W-1]`` (model dtype)
  and ``ssm [R, H, P, N]`` (float32). Each layer's mixer has its window and scan kernels store the
  boundary states straight into its rows (``conv_windows_before`` / ``ssd_scan_varlen_pooled``
  with ``out_rows`` / ``emit_rows``); the first Mamba layer of a step restores rows into pool slots
  for every layer at once. Index tensors come staged with the step (no host sync).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import torch

logger = logging.getLogger("hybrid_engine")


class CheckpointIndex:
    """Rows 0..num_rows-1. A row is *free*, *pinned* (pins > 0: a save in flight not yet
    committed, or a restore scheduled) or *cached* (hashed, pins == 0). Only free and cached rows
    are handed out; a pinned row is never evicted.

    Eviction order: cached rows on a straight chain first, then the others, each least recently
    used first. A checkpoint is on a straight chain when exactly one deeper checkpoint was
    committed on chains through it (``continued``): every request that passed it so far went on
    to the same next checkpoint, which holds a deeper state of the same tokens. That is a chat's
    previous turn once its next turn saved (the turn after restores the deeper one), or an
    interval checkpoint inside one conversation. Such a row is worth less than a chain's end (the
    only state at its depth) or a branch point (a system prompt that several conversations
    continued differently). Under plain LRU a pool with more rows than conversations still lost
    most chains' ends: every turn saves one or two checkpoints beside the one the next turn
    needs, and the useless ones pushed it out (docs/design.md, "Prefix caching")."""

    def __init__(self, num_rows: int):
        if num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {num_rows}")
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._pins = [0] * num_rows
        self._hash: list[bytes | None] = [None] * num_rows
        self._by_hash: dict[bytes, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()        # cached rows, evicted second
        self._straight: OrderedDict[int, None] = OrderedDict()   # cached rows on a straight chain, first
        # per row: up to two distinct deeper checkpoints committed on chains through it (two
        # already make it a branch point)
        self._next: list[set[bytes]] = [set() for _ in range(num_rows)]
        # deeper checkpoint's hash -> rows whose one continuation it may be: when it is forgotten,
        # such a row is the deepest state of its chain again (a chain end, not a straight row)
        self._continues: dict[bytes, list[int]] = {}
        self.num_evictions = 0

    @property
    def num_used(self) -> int:
        """Rows holding a checkpoint or pinned by a save in flight."""
        return self.num_rows - len(self._free)

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self._pins if p)

    @property
    def num_straight(self) -> int:
        """Cached rows on a straight chain (the first to be evicted)."""
        return len(self._straight)

    def pins(self, row: int) -> int:
        return self._pins[row]

    def get(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def allocate(self) -> int | None:
        """A row for a new save, pinned; None when every row is pinned (the save is skipped)."""
        if self._free:
            row = self._free.pop()
        elif self._straight or self._lru:
            row, _ = (self._straight or self._lru).popitem(last=False)
            self._forget(row)
            self.num_evictions += 1
        else:
            return None
        self._pins[row] = 1
        return row

    def commit(self, row: int, block_hash: bytes) -> None:
        """The save into pinned ``row`` ran: it now holds the checkpoint of ``block_hash``."""
        self._unpin_checked(row)
        if block_hash in self._by_hash or self._hash[row] is not None:
            self._release(row)                       # a duplicate (saved twice concurrently)
            return
        self._hash[row] = block_hash
        self._by_hash[block_hash] = row
        self._settle(row)

    def continued(self, block_hash: bytes, deeper_hash: bytes) -> None:
        """A request whose chain passes the checkpoint of ``block_hash`` committed (or passed)
        the checkpoint of ``deeper_hash`` next on that chain: with one such continuation the row
        is on a straight chain, with two it is a branch point."""
        row = self._by_hash.get(block_hash)
        if row is None or deeper_hash == block_hash or deeper_hash not in self._by_hash:
            return                                   # (a deeper checkpoint already evicted: none)
        nxt = self._next[row]
        if len(nxt) >= 2 or deeper_hash in nxt:
            return
        nxt.add(deeper_hash)
        if len(nxt) == 1:
            self._continues.setdefault(deeper_hash, []).append(row)
        if self._pins[row] == 0:                     # a pinned row is placed when it settles
            (self._lru if len(nxt) == 1 else self._straight).pop(row, None)
            self._settle(row)

    def discard(self, row: int) -> None:
        """The save into pinned ``row`` never ran (its step failed, or its request was preempted
        or aborted first): the row returns to the free list."""
        self._unpin_checked(row)
        self._release(row)

    def pin(self, row: int) -> None:
        """A restore reads ``row`` in the step being scheduled."""
        if self._hash[row] is None:
            raise ValueError(f"checkpoint row {row} holds no checkpoint")
        if self._pins[row] == 0:
            self._order(row).pop(row)
        self._pins[row] += 1

    def unpin(self, row: int) -> None:
        self._unpin_checked(row)
        self._settle(row)

    def touch(self, row: int) -> None:
        order = self._order(row)
        if row in order:
            order.move_to_end(row)

    def drop(self, block_hash: bytes) -> None:
        """Forget the checkpoint of ``block_hash`` if nothing pins it (its KV block was evicted)."""
        row = self._by_hash.get(block_hash)
        if row is None or self._pins[row]:
            return
        self._order(row).pop(row)
        self._forget(row)
        self._free.append(row)

    def _order(self, row: int) -> OrderedDict:
        """The eviction list a cached row belongs on."""
        return self._straight if len(self._next[row]) == 1 else self._lru

    def _forget(self, row: int) -> None:
        """``row`` (off every list) no longer holds its checkpoint. A row whose one continuation
        that was becomes a chain end again (a branch point stays one)."""
        h = self._hash[row]
        del self._by_hash[h]
        self._hash[row] = None
        self._next[row] = set()
        for parent in self._continues.pop(h, ()):
            if self._next[parent] == {h}:                # (a reused row has another set)
                if self._pins[parent] == 0:
                    self._straight.pop(parent)
                self._next[parent] = set()
                self._settle(parent)

    def _unpin_checked(self, row: int) -> None:
        if self._pins[row] <= 0:
            raise ValueError(f"checkpoint row {row} is not pinned")
        self._pins[row] -= 1

    def _settle(self, row: int) -> None:
        if self._pins[row] == 0:
            if self._hash[row] is not None:
                self._order(row)[row] = None
            else:
                self._free.append(row)

    def _release(self, row: int) -> None:
        if self._pins[row] == 0 and self._hash[row] is None:
            self._free.append(row)


class MambaCheckpoints:
    """Device storage of the checkpoint rows, per Mamba layer (the model's Mamba ordinals)."""

    def __init__(self, num_layers: int, num_rows: int, conv_dim: int, conv_kernel: int, num_heads: int,
                 head_dim: int, state_size: int, dtype: torch.dtype, device: torch.device):
        self.num_rows = num_rows
        # per layer: views of one tensor over all layers, so a restore is one op for every layer
        self.conv_all = torch.zeros(num_layers, num_rows, conv_dim, conv_kernel - 1, dtype=dtype,
                                    device=device)                          # [L, R, C, W-1]
        self.ssm_all = torch.zeros(num_layers, num_rows, num_heads, head_dim, state_size, dtype=torch.float32,
                                   device=device)                           # [L, R, H, P, N] f32
        self.conv = list(self.conv_all.unbind(0))                           # [R, C, W-1] per layer
        self.ssm = list(self.ssm_all.unbind(0))                             # [R, H, P, N] per layer
        logger.info("mamba prefix checkpoints: %d layers x %d rows, %.1f MiB", num_layers, num_rows,
                    self.bytes / 2**20)

    @staticmethod
    def bytes_per_row(num_layers: int, conv_dim: int, conv_kernel: int, num_heads: int, head_dim: int,
                      state_size: int, dtype: torch.dtype) -> int:
        elt = torch.empty(0, dtype=dtype).element_size()
        return num_layers * (conv_dim * (conv_kernel - 1) * elt + num_heads * head_dim * state_size * 4)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_all, self.ssm_all))

    def restore(self, pool, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Pool slots := checkpoint rows, in every Mamba layer at once (conv window columns
        0..W-2, SSM checkpoint 0): two Triton launches on CUDA (``ops/triton_restore.py``; the
        torch twin elsewhere), not ops per layer. ``pool``: the
        ``MambaPool`` of the same model; slots, rows: [M] int64 device tensors (a negative row:
        a padding entry, skipped)."""
        from .ops.triton_common import kernel_backend
        if kernel_backend("checkpoint_restore", self.ssm_all.device) == "triton":
            from .ops.triton_restore import triton_restore_rows as restore_rows   # 2 launches
        else:
            restore_rows = restore_rows_ref
        wm1 = self.conv_all.shape[-1]
        restore_rows(self.conv_all, pool.conv_all[..., :wm1], rows, slots)
        restore_rows(self.ssm_all, pool.ssm_all[:, :, 0], rows, slots)


def restore_rows_ref(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """``dst[:, slots[m]] = src[:, rows[m]]`` for each m with ``rows[m] >= 0``; a negative row is a
    padding entry that leaves its slot as it is (src [L, R, *inner], dst [L, S, *inner], a view of
    the pool): the torch twin of ``ops/triton_restore.triton_restore_rows``. No host read: a
    padding entry writes its slot's own value back."""
    keep = (rows >= 0).view(1, -1, *([1] * (src.dim() - 2)))
    dst[:, slots] = torch.where(keep, src[:, rows.clamp(min=0)].to(dst.dtype), dst[:, slots])
