"""The runner's part of ``n > 1`` (scheduling/fork.py): a sibling's caches start as a copy of its
leader's after the leader's first P-1 prompt tokens. Called while the batch is updated, before
the step's forward, so on the device stream the copy follows the leader's earlier chunks and
precedes the leader's last prompt token (which this same step runs). Device-to-device copies
only, launched with host ints (no index tensor to upload, no sync): every Mamba layer's slot
(conv window, SSM state, pending inputs) and, per attention layer, the KV of each of the leader's
blocks covering those tokens into the sibling's own blocks (copied, not shared: blocks carry
no reference count)."""
from __future__ import annotations

import torch

from ..models.nemotron_h import Caches
from ..scheduling.scheduler_output import ForkSource


@torch.inference_mode()
def fork_state(caches: Caches, fork: ForkSource, dst_slot: int) -> None:
    kv = caches.kv
    caches.mamba.copy_slot(dst_slot, fork.src_slot)                         # every Mamba layer at once
    pairs = list(zip(fork.src_blocks, fork.dst_blocks))
    for k, v in zip(kv.k, kv.v):
        for src, dst in pairs:
            k[dst].copy_(k[src])
            v[dst].copy_(v[src])
