"""N-gram (prompt lookup) drafter, entirely on the device.

Per request *slot* (fixed for a request's life) the drafter keeps the request's token history on the
device: ``history[slot, :length[slot]]`` is the prompt (plus, for a resumed request, its earlier
outputs) followed by every valid token sampled since. Each step ``propose``:

1. appends the step's valid sampled tokens to their slot rows (a masked scatter: invalid entries go
   to a scratch column) and sets ``length[slot] = input_pos + 1`` for rows that sampled something;
2. for every row that sampled something, looks for the longest n in [min_n, max_n] whose last-n-token
   suffix occurs earlier in the row (an occurrence ending before the last token), takes the most
   recent occurrence and proposes the K tokens that followed it. An occurrence that ends v < K
   tokens back has only v tokens after it; the copy then goes on from its own start, as an
   overlapping copy does (the text it predicts repeats with period v), so a row stuck in a short
   loop gets K drafts, not v.

No host synchronisation: positions and lengths never leave the device, there is no ``.item()``,
``nonzero`` or boolean-mask indexing, and no Python loop. Two implementations of steps 1-2:

- ``_append`` + ``_search`` (torch): one comparison of unfolded windows covers every row, position
  and n; the work is O(B * window * max_n) per step, ~65 small kernels. The CPU path and the oracle.
- ``triton_ngram.NgramTritonKernel``: both steps in one Triton launch, one program per step row
  (CUDA; on CPU only under ``TRITON_INTERPRET=1``, for tests). Results are identical.

``backend="auto"`` picks Triton for CUDA devices (``HYBRID_ENGINE_KERNELS=torch`` forces torch) like
the Mamba ops (``mamba_cache.ops.triton_common.kernel_backend``); the choice is logged once. Host
(new requests' token ids) reaches the device through the drafter's own ``H2D`` staging ring, in one
transfer per step (pending ``add_request`` calls are flushed at the start of the next ``propose``),
so a ring slot is reused only after the step that filled it has been read back.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch
import torch.nn.functional as F

from hybrid_engine.step.transfer import H2D
from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend

from .base import DraftContext, Drafter

NO_TOKEN = -1      # empty history cells and "no draft"
PAD = -2           # past the start of a row in the search windows
SENTINEL = -3      # ends every n-gram: never equal to a token, NO_TOKEN or PAD
BACKENDS = ("auto", "torch", "triton")

logger = logging.getLogger("hybrid_engine")
_logged: set[tuple[str, str]] = set()


class NgramDrafter(Drafter):
    has_probs = False
    full_context = False          # reads slots, sampled, num_valid, input_pos only

    def __init__(self, num_spec: int, min_n: int, max_n: int, num_slots: int, max_len: int,
                 device: torch.device | str, h2d: H2D | None = None, window: int | None = None,
                 backend: str = "auto"):
        """``num_slots`` slot rows of ``max_len`` tokens each. ``window`` (default: ``max_len``) bounds
        the search to the last ``window`` tokens of a row; ``h2d`` defaults to an own staging ring.
        ``backend``: "auto" (Triton on CUDA, else torch), "torch" or "triton" (CUDA, or any device
        under ``TRITON_INTERPRET=1``)."""
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if num_spec < 1 or num_slots < 1 or max_len < 2:
            raise ValueError(f"bad sizes: num_spec={num_spec}, num_slots={num_slots}, max_len={max_len}")
        self.num_spec, self.min_n, self.max_n = num_spec, min_n, max_n
        self.num_slots, self.max_len = num_slots, max_len
        self.device = torch.device(device)
        self.h2d = h2d if h2d is not None else H2D(self.device)
        self.window = max_len if window is None else max(2, min(window, max_len))
        # Two extra columns per row: column max_len is scratch (masked-out writes land there, nothing
        # reads it), column max_len + 1 (= column -1) stays NO_TOKEN and is read for positions < 0.
        self._store = torch.full((num_slots, max_len + 2), NO_TOKEN, dtype=torch.int64, device=self.device)
        self.history = self._store[:, :max_len]                                  # [num_slots, max_len]
        self.length = torch.zeros(num_slots, dtype=torch.int64, device=self.device)  # [num_slots]
        self._pending: dict[int, tuple[int, ...]] = {}
        w = self.window
        self._m = min(max_n, w - 1)                      # longest n-gram that fits the window
        dev = self.device
        self._back = torch.arange(w, device=dev)         # [W] v: the v-th last token of a row
        self._v1 = torch.arange(1, w, device=dev)        # [W-1] occurrence ends v >= 1 tokens back
        self._ar_drafts = torch.arange(num_spec, device=dev)    # [K] draft index
        self._ar_row = torch.arange(1 + num_spec, device=dev)   # [1+K] sampled-token index in a row
        self.backend = self._choose_backend(backend)
        self._kernel = None
        if self.backend == "triton":
            from .triton_ngram import NgramTritonKernel
            self._kernel = NgramTritonKernel(num_spec, min_n, self._m, max_len, w)

    def _choose_backend(self, backend: str) -> str:
        """'torch' or 'triton' (see __init__); logs the choice once per (device type, backend)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        dev = self.device
        if backend == "auto":
            # logs "ngram_propose backend on <device>: triton | torch_ref" once
            return "triton" if kernel_backend("ngram_propose", dev) == "triton" else "torch"
        if backend == "triton" and dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"backend='triton' on {dev.type} needs TRITON_INTERPRET=1 (set before "
                             "Triton is imported)")
        key = (dev.type, backend)
        if key not in _logged:
            _logged.add(key)
            logger.info("ngram_propose backend on %s: %s (requested)", dev.type, backend)
        return backend

    # ------------------------------------------------------------------------------------------ slots
    def add_request(self, slot: int, token_ids) -> None:
        """Reset ``slot`` to ``token_ids`` (rest -1). Queued on the host; the device copy happens in one
        transfer at the start of the next ``propose`` (or ``flush``), before anything reads the slot."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")
        self._pending[int(slot)] = tuple(token_ids)

    def flush(self) -> None:
        """Apply queued ``add_request`` resets on the device (no host sync: one non-blocking H2D)."""
        if not self._pending:
            return
        slots = np.fromiter(self._pending.keys(), dtype=np.int64, count=len(self._pending))
        seqs = [np.asarray(ids, dtype=np.int64)[:self.max_len] for ids in self._pending.values()]
        self._pending = {}
        lens = np.array([len(ids) for ids in seqs], dtype=np.int64)
        toks = np.concatenate(seqs)
        rows = np.repeat(slots, lens)
        cols = np.concatenate([np.arange(n, dtype=np.int64) for n in lens])
        self.h2d.begin_step()
        slots_t, lens_t, toks_t, rows_t, cols_t = self.h2d.put(slots, lens, toks, rows, cols)
        self._store.index_fill_(0, slots_t, NO_TOKEN)
        self._store.index_put_((rows_t, cols_t), toks_t)
        self.length.index_copy_(0, slots_t, lens_t)

    # ---------------------------------------------------------------------------------------- propose
    def propose(self, ctx: DraftContext) -> tuple[torch.Tensor, None]:
        self.flush()
        num_drafts = ctx.drafts_wanted(self.num_spec)    # the search finds K; the step verifies the first k
        if self._kernel is not None:                     # append + search in one launch
            drafts = self._kernel(self._store, self.length, ctx.slots, ctx.sampled, ctx.num_valid, ctx.input_pos)
            return (drafts if num_drafts == self.num_spec else drafts[:, :num_drafts]), None
        slots = ctx.slots.long()                         # [B] step row -> slot
        num_valid = ctx.num_valid.long()                 # [B] valid sampled tokens (0..1+K)
        self._append(slots, ctx.sampled.long(), num_valid, ctx.input_pos.long())
        if not num_drafts:
            return ctx.sampled.new_empty(ctx.sampled.shape[0], 0), None
        drafts = self._search(slots, num_valid > 0)
        return (drafts if num_drafts == self.num_spec else drafts[:, :num_drafts]), None

    def _append(self, slots: torch.Tensor, sampled: torch.Tensor, num_valid: torch.Tensor,
                last_pos: torch.Tensor) -> None:
        """slots [B], sampled [B, 1+k], num_valid [B], last_pos [B] (the position of a row's last
        valid token): sampled token j < num_valid sits at position last_pos - num_valid + 1 + j."""
        j = self._ar_row[:sampled.shape[1]]                                  # [1+k]
        pos = (last_pos - num_valid + 1)[:, None] + j                        # [B, 1+k]
        col = torch.where((j < num_valid[:, None]) & (pos < self.max_len), pos, self.max_len)  # else scratch
        self._store.index_put_((slots[:, None].expand_as(col), col), sampled)
        new_len = torch.where(num_valid > 0, (last_pos + 1).clamp(max=self.max_len), self.length[slots])
        self.length.index_put_((slots,), new_len)

    def _search(self, slots: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """[B, K] drafts for rows with ``active``, -1 elsewhere.

        Backward coordinates: ``rev[b, v]`` is the v-th last token of the row (v = 0: the last one;
        NO_TOKEN before position 0), so ``rev[b, :n]`` is the n-gram to find and an occurrence ending
        v tokens back (v >= 1, i.e. not the suffix itself) matches it for every n up to
        ``run[b, v]`` = the number of leading t with ``rev[b, v + t] == rev[b, t]``. One comparison
        of unfolded windows gives ``run`` for all n at once; the best occurrence maximises
        (n, -v): the longest n, then the most recent.
        """
        w, m = self.window, self._m
        length = self.length[slots]                                          # [B]
        pos = (length[:, None] - 1 - self._back).clamp(min=-1)               # -1: the NO_TOKEN column
        rev = self._store[slots[:, None], pos]                               # [B, W]
        win = F.pad(rev, (0, m), value=PAD).unfold(1, m + 1, 1)[:, 1:]       # [B, W-1, m+1] v >= 1
        # the n-gram tokens t < m, then a sentinel that never matches: run stops at m at the latest
        gram = F.pad(rev[:, :m], (0, 1), value=SENTINEL)                     # [B, m+1]
        run = (win != gram[:, None, :]).view(torch.uint8).argmax(-1)         # [B, W-1] first mismatch
        n = torch.minimum(run, (length - 1)[:, None])                        # the n-gram must be real tokens
        score = torch.where(n >= self.min_n, n * w - self._v1, -1)           # longest n, then smallest v
        best = score.amax(1)                                                 # [B]
        back = (-best) % w                                                   # [B] v: the occurrence ends v back
        start = length - back                                                # position after the occurrence
        p = start[:, None] + self._ar_drafts % back[:, None]                 # [B, K] overlapping copy (period v)
        valid = (best >= 0)[:, None] & (p < length[:, None]) & active[:, None]
        drafts = self._store[slots[:, None], p.clamp(max=self.max_len)]
        return torch.where(valid, drafts, NO_TOKEN)


def make_ngram(build) -> NgramDrafter:
    """The engine's n-gram drafter: one history row per Mamba slot (null slot included)."""
    spec = build.cfg.speculative
    num_spec = spec.num_speculative_tokens
    device = build.device
    # built before the runner: the drafter stages through its own H2D ring
    return NgramDrafter(num_spec, spec.prompt_lookup_min, spec.prompt_lookup_max, num_slots=build.num_slots,
                        max_len=build.max_model_len + 2 * (1 + num_spec) + 1, device=device, h2d=H2D(device))
