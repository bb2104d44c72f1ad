"""A prefill graph's static inputs as one device arena, filled by one H2D copy (issue 19).

A request arriving at an idle engine runs a prefill-only step: every one of its forward inputs is
known on the host. ``load_prefill`` copies a staged batch into a graph's static buffers with ~30
device ops (~0.3-0.55 ms of host time on the H100 machines' CPUs, before the replay: a cached
request's TTFT pays all of it). Here the static buffers of a key are views of one int64 arena
(``PrefillStatic``), so ``MixedPlan`` writes the step's host image of the arena
(``PrefillStatic.write``, the values ``load_prefill`` would leave, pad tokens zeroed) into the pinned staging ring
and sends it with one copy; the step's ``ForwardBatch`` is a view of the arena at the real sizes
(``PrefillStatic.view``), and the forward, seeing its inputs already in place, replays without
copies. Only prefill-only keys (no decode rows) take this path: a mixed step's decode rows come
from the previous step's device outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from hybrid_engine.mamba_cache import NULL_SLOT

from .forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
from .prefill_layout import PrefillKey

# the static tensors of a ForwardBatch, by (part, field): part None is the batch itself
_TENSORS = ((None, "input_ids"), (None, "positions"), ("attn", "query_start_loc"), ("attn", "seq_lens"),
            ("attn", "block_tables"), ("attn", "slot_mapping"), ("mamba", "decode_slots"),
            ("mamba", "num_accepted"), ("mamba", "prefill_query_start_loc"), ("mamba", "prefill_slots"),
            ("mamba", "has_initial_state"), ("mamba", "restore_slots"), ("mamba", "restore_rows"),
            ("mamba", "ckpt_seq"), ("mamba", "ckpt_token"), ("mamba", "ckpt_rows"), (None, "logits_indices"))
_NP_DTYPE = {torch.int64: np.int64, torch.int32: np.int32, torch.bool: np.bool_}


@dataclass(frozen=True)
class PrefillHost:
    """A prefill-only step's forward inputs on the host: one prefill row of T tokens."""
    input_ids: np.ndarray        # [T] int64
    positions: np.ndarray        # [T] int64
    slot_mapping: np.ndarray     # [T] int64 KV slots
    block_table: np.ndarray      # [C] int32, C <= the graphs' max_blocks
    seq_len: int                 # start + T
    slot: int                    # the row's Mamba pool slot
    has_initial_state: bool      # the chunk continues an earlier chunk (or a restore)
    restore: tuple[int, int] | None   # (pool slot, checkpoint row) restored before the forward
    ckpt_token: np.ndarray       # [M] int64 prefill-token index before each saved boundary
    ckpt_rows: np.ndarray        # [M] int64 checkpoint rows written
    logits: bool                 # the row samples: its last token's logits are computed


@dataclass(frozen=True)
class PrefillStatic:
    """A prefill-only key's static inputs: ``fb``'s tensors are views of ``arena``."""
    key: PrefillKey
    fb: ForwardBatch                        # the graph's static batch (bucket-sized, the pad row)
    arena: torch.Tensor                     # [W] int64 device words holding every tensor of fb
    template: np.ndarray                    # [W] int64 the arena as built (the fixed parts)
    host: np.ndarray                        # [W] int64 host scratch the image is built in
    fields: dict[str, np.ndarray]           # field name -> its flat view of ``host``, in its dtype

    def write(self, image: np.ndarray, h: PrefillHost) -> None:
        """Write into ``image`` ([W] int64 host words) what ``load_prefill`` leaves in the static
        buffers for the step ``h``, except that pad tokens get token 0 and position 0 (load_prefill
        leaves an earlier step's there; either is harmless: the pad row is a fresh NULL_SLOT row
        past attention's one row, writing the null KV block). Built in ``host`` (views made once)
        and copied: ``image`` is a new staging slot every step."""
        key, t, f = self.key, h.input_ids.shape[0], self.fields
        if not 0 < t < key.bucket or h.block_table.shape[0] > self.fb.attn.block_tables.shape[1]:
            # a field would spill into the next one (load_prefill's copies would raise here)
            raise ValueError(f"a step of {t} tokens and {h.block_table.shape[0]} blocks does not fit "
                             f"{key} (bucket > tokens, at most {self.fb.attn.block_tables.shape[1]} blocks)")
        self.host[:] = self.template
        f["input_ids"][:t] = h.input_ids
        f["positions"][:t] = h.positions
        f["attn.query_start_loc"][1] = t
        f["attn.seq_lens"][0] = h.seq_len
        f["attn.block_tables"][:h.block_table.shape[0]] = h.block_table      # row 0; the rest stay 0
        f["attn.slot_mapping"][:t] = h.slot_mapping
        f["mamba.prefill_query_start_loc"][1] = t
        f["mamba.prefill_slots"][0] = h.slot
        f["mamba.has_initial_state"][0] = h.has_initial_state
        if key.restores:
            f["mamba.restore_rows"][0] = -1 if h.restore is None else h.restore[1]
            f["mamba.restore_slots"][0] = NULL_SLOT if h.restore is None else h.restore[0]
        if key.saves:
            m = h.ckpt_rows.shape[0]
            for name, vals in (("mamba.ckpt_token", h.ckpt_token), ("mamba.ckpt_rows", h.ckpt_rows)):
                f[name][:m] = vals
                f[name][m:] = vals[m - 1]    # the padded saves repeat the last one (same values, same row)
            # ckpt_seq stays 0: every save is of the one prefill row
        if key.logits:
            f["logits_indices"][0] = t - 1
        image[:] = self.host

    def view(self, h: PrefillHost, *, decode_len: int, num_accepted: torch.Tensor) -> ForwardBatch:
        """The step's ForwardBatch as views of the arena at the real sizes (what MixedPlan's staged
        batch would be); the forward replays the graph on it without copies."""
        f, t = self.fb, h.input_ids.shape[0]
        a, m = f.attn, f.mamba
        saves = h.ckpt_rows.shape[0]
        restored = h.restore is not None
        return ForwardBatch(
            input_ids=f.input_ids[:t], positions=f.positions[:t],
            attn=AttnMetadata(query_start_loc=a.query_start_loc, seq_lens=a.seq_lens,
                              block_tables=a.block_tables[:, :h.block_table.shape[0]],
                              slot_mapping=a.slot_mapping[:t], max_query_len=t, max_seq_len=h.seq_len),
            mamba=MambaMetadata(num_decode_rows=0, decode_len=decode_len, decode_slots=m.decode_slots,
                                num_accepted=num_accepted, prefill_query_start_loc=m.prefill_query_start_loc[:2],
                                prefill_qsl_cpu=(0, t), prefill_slots=m.prefill_slots[:1],
                                has_initial_state=m.has_initial_state[:1],
                                restore_slots=m.restore_slots if restored else None,
                                restore_rows=m.restore_rows if restored else None,
                                ckpt_seq=m.ckpt_seq[:saves] if saves else None,
                                ckpt_token=m.ckpt_token[:saves] if saves else None,
                                ckpt_rows=m.ckpt_rows[:saves] if saves else None),
            logits_indices=f.logits_indices)


def in_arena(key: PrefillKey, fb: ForwardBatch) -> PrefillStatic:
    """``fb`` (a freshly built static batch) moved into one int64 arena: same values, every tensor
    a view of it (one word-aligned region each); ``host`` and its ``fields`` are the host twin."""
    layout, words = [], 0                  # (part, name, "part.name", tensor, word offset, words)
    for part, name in _TENSORS:
        t = getattr(fb if part is None else getattr(fb, part), name)
        if t is not None:
            w = (t.numel() * t.element_size() + 7) // 8
            layout.append((part, name, name if part is None else f"{part}.{name}", t, words, w))
            words += w
    arena = torch.zeros(max(words, 1), dtype=torch.int64, device=fb.input_ids.device)
    views: dict[str | None, dict[str, torch.Tensor]] = {None: {}, "attn": {}, "mamba": {}}
    for part, name, _, t, off, w in layout:
        views[part][name] = v = arena[off:off + w].view(t.dtype)[:t.numel()].view(t.shape)
        v.copy_(t)
    moved = replace(fb, attn=replace(fb.attn, **views["attn"]), mamba=replace(fb.mamba, **views["mamba"]),
                    **views[None])
    template = arena.cpu().numpy().copy()
    host = template.copy()
    fields = {full: host[off:off + w].view(_NP_DTYPE[t.dtype])[:t.numel()] for _, _, full, t, off, w in layout}
    return PrefillStatic(key=key, fb=moved, arena=arena, template=template, host=host, fields=fields)
