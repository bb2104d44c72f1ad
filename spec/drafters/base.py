"""The drafter hook: the runner calls ``propose`` once per step, after sampling."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftContext:
    """Everything a drafter may read about the step just sampled, in step-row space. The fields
    marked ``| None`` are None for drafters with ``full_context = False``."""
    req_ids: tuple[str, ...]
    slots: torch.Tensor          # [B] int64 Mamba/drafter slot per row (fixed for a request's life)
    sampled: torch.Tensor        # [B, 1+K] int64, -1 after the last valid token
    num_valid: torch.Tensor      # [B] int64 (0: the row sampled nothing, e.g. a partial prefill)
    input_token: torch.Tensor | None  # [B] int64 last valid sampled token, or the backup token
    input_pos: torch.Tensor      # [B] int64 absolute position of input_token
    hidden: torch.Tensor         # [T, D] target hidden states of this step (MTP reads them)
    token_index: torch.Tensor | None  # [B] int64 index into hidden of the token that produced input_token
    is_decode: torch.Tensor      # [B] bool row was a verify row this step
    query_start_loc: torch.Tensor  # [B+1] int64 token offsets of the rows in this step
    input_ids: torch.Tensor      # [T] int64 the target's input tokens of this step (placeholders clamped)
    positions: torch.Tensor      # [T] int64
    next_input_ids: torch.Tensor # [T] int64 the token after each input token where the host knows it
                                 # (inside prefill chunks), else -1 (verify rows, a chunk's last token)
    forward_batch: object        # the target's ForwardBatch of this step (a draft model replays it)
    sampling: object             # SamplingTensors for all B rows (drafts of random rows are sampled)
    block_size: int
    num_drafts: int | None = None  # drafts to propose per row, 0..K (the next step's width, host-chosen
                                   # by the runner's draft policy; None: K): propose returns [B, num_drafts]

    def drafts_wanted(self, num_spec: int) -> int:
        return num_spec if self.num_drafts is None else self.num_drafts


@dataclass(frozen=True)
class DrafterBuild:
    """What a drafter factory (``DRAFTERS[method](build)``) may read: the engine's sizes, device
    and config, and the target model. Built once by the engine before the runner exists."""
    cfg: object                  # EngineConfig (speculative, dtype, device, enforce_eager, scheduler)
    model: object                # the target model (MTP shares its layers, embedding and lm_head)
    num_spec: int                # K drafts per decode row
    max_model_len: int
    max_num_seqs: int
    block_size: int              # KV block size; a drafter's own KV cache uses the target's block ids
    num_kv_blocks: int           # target KV blocks, null block 0 included
    max_blocks_per_req: int      # block-table width
    num_slots: int               # Mamba/drafter slots, null slot 0 included (slot space)
    # the target's steps of one prefill row replay prefill graphs (prefill_cuda_graphs, one GPU): a
    # draft model's replay of those steps may too
    prefill_graphs: bool = False
    # prefix caching: attach_checkpoints gives the drafter checkpoint rows after it is built (its
    # prefill graphs' keys then pad restores to one, as the target's do)
    checkpoints: bool = False

    @property
    def device(self):
        return self.cfg.device

    @property
    def dtype(self):
        return self.cfg.dtype


@dataclass(frozen=True)
class CacheFootprint:
    """Device memory a drafter will take beside the target, known before the engine sizes its KV
    cache (so that the target's share of ``kv_cache_memory_fraction`` leaves room for it)."""
    fixed_bytes: int = 0          # weights and per-slot state, independent of the number of KV blocks
    kv_bytes_per_block: int = 0   # the drafter's own KV for each target block id (draft models share ids)


class Drafter:
    num_spec: int = 0
    # fills draft_probs [B, K, V] (float32) for probabilistic rejection of random rows: their tokens
    # then depend on how many drafts a step verifies (adaptive speculation keeps K fixed for them)
    has_probs: bool = False
    # False: propose never reads input_token or token_index; the runner passes None for them and
    # spares the device ops that derive them every step.
    full_context: bool = True

    def checkpoint_bytes_per_row(self) -> int:
        """Prefix caching: bytes a Mamba checkpoint row of the drafter's own state takes (0: the
        drafter keeps no Mamba state; n-gram history is the tokens, MTP's KV lives in the
        target's blocks)."""
        return 0

    def attach_checkpoints(self, num_rows: int) -> None:
        """Prefix caching: allocate ``num_rows`` checkpoint rows of the drafter's own Mamba
        state, the same rows as the target's (a restore or save names one row for both)."""

    def add_request(self, slot: int, token_ids: tuple[int, ...]) -> None:
        """A request (new or resumed) got ``slot``; reset every slot-indexed field it owns."""

    def propose(self, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (drafts [B, ctx.num_drafts] int64, -1 = no draft; draft probs [B, num_drafts, V] or None).
        With num_drafts = 0 a drafter still follows the step (its history, caches, states)."""
        raise NotImplementedError


class NoDrafter(Drafter):
    full_context = False

    def __init__(self):
        self._empty: dict[tuple[int, torch.device], torch.Tensor] = {}   # [B, 0] by row count

    def propose(self, ctx: DraftContext):
        key = (ctx.sampled.shape[0], ctx.sampled.device)
        e = self._empty.get(key)
        if e is None:
            e = self._empty[key] = torch.empty(key[0], 0, dtype=torch.int64, device=key[1])
        return e, None
