"""Prefix caching, the scheduler's side (docs/design.md, "Prefix caching").

A full block of a request's tokens is named by a hash chain: ``h_k = H(h_{k-1}, tokens of block
k, lookahead tokens)``, so equal hashes mean equal tokens at equal positions from the start (the
KV and the Mamba state of a position depend on nothing else in one engine). ``lookahead`` is 1
with the MTP drafter: its KV at the last position of a block pairs the target's hidden state with
the *next* token, so that token is part of what the block holds.

Two caches share the chain:

- KV blocks (``CachingBlockAllocator``): a computed full block is registered under its hash; a
  new request takes references on the longest cached prefix of its blocks.
- Mamba checkpoints (``CheckpointIndex`` rows + ``MambaCheckpoints`` tensors): the conv window
  and SSM state after block boundary ``q`` (keyed by the hash of the block ending at ``q``),
  saved by the prefill chunk that crosses ``q``: every ``interval`` blocks, at the last full
  block of the prefill target, and where an admitted request's cached KV blocks end beyond its
  deepest checkpoint (the point where it leaves a prefix that an earlier request computed: the
  next request sharing that prefix restores there, wherever the interval's boundaries fall and
  whatever the lookahead cut off).

Restore rule: a new (or resumed) request restores the deepest boundary ``q`` such that its KV
blocks 0..q/bs-1 are all cached, the checkpoint at ``q`` is cached, and ``q <= L - 1`` (the last
token to prefill is always computed: its logits are needed). It prefills ``[q, L)`` only.
Everything here depends on the tokens and the interval, never on the chunk budget, so the hit
depth does not either.

Registration is deferred to the commit of the step that computed the block / saved the state:
by then the device work is ordered before any later reader (one stream), and a failed step
never publishes anything.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..attention.block_pool import CachingBlockAllocator
from hybrid_engine.mamba_cache.checkpoints import CheckpointIndex
from .request import Request, Status

ROOT_HASH = b"hybrid-engine-prefix-v1"


def hash_blocks(tokens: list[int], block_size: int, lookahead: int, parent: bytes = ROOT_HASH,
                start_block: int = 0) -> list[bytes]:
    """Chain hashes of the full blocks ``start_block, start_block+1, ...`` of ``tokens`` (block k
    covers tokens [k*bs, (k+1)*bs + lookahead)); ``parent`` is the hash of block start_block-1."""
    end_block = (len(tokens) - lookahead) // block_size         # blocks whose lookahead is known
    if end_block <= start_block:
        return []
    # one int64 byte string of the tokens involved, sliced per block (no numpy op per block)
    data = memoryview(np.asarray(tokens[start_block * block_size:end_block * block_size + lookahead],
                                 dtype=np.int64).tobytes())
    step, span = 8 * block_size, 8 * (block_size + lookahead)
    out = []
    for off in range(0, (end_block - start_block) * step, step):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(data[off:off + span])
        parent = h.digest()
        out.append(parent)
    return out


class RecentChains:
    """The hash chains of the last few prompts hashed, beside their tokens: a new prompt that
    shares a prefix with one of them takes those hashes and hashes only the rest. A chat resends
    its system prompt and history every turn; hashing 2k tokens costs ~0.1 ms on a fast host and
    0.25-0.55 ms on the H100 machines' CPUs, before the step that serves the turn can launch."""

    def __init__(self, block_size: int, lookahead: int, size: int = 4):
        self.block_size, self.lookahead, self.size = block_size, lookahead, size
        self._entries: list[tuple[np.ndarray, list[bytes]]] = []   # (tokens [n], chain over them), newest first
        self.reused_blocks = 0                                      # blocks whose hash was taken, not computed

    def chain(self, tokens) -> list[bytes]:
        """``hash_blocks(tokens, block_size, lookahead)`` (from ROOT_HASH), equal by construction:
        block k's hash is reused only from a chain whose tokens equal these on every position it
        covers, ``[0, (k+1)*bs + lookahead)``."""
        bs, la = self.block_size, self.lookahead
        arr = np.array(tokens, dtype=np.int64)        # a copy: it is kept, and the caller's may change
        best: list[bytes] = []
        reuse = 0
        for e_tokens, e_chain in self._entries:
            n = min(e_tokens.shape[0], arr.shape[0])
            diff = np.flatnonzero(e_tokens[:n] != arr[:n])
            same = int(diff[0]) if diff.shape[0] else n               # equal leading tokens
            k = min(len(e_chain), max(same - la, 0) // bs)
            if k > reuse:
                best, reuse = e_chain, k
        out = best[:reuse]
        out += hash_blocks(arr, bs, la, out[-1] if out else ROOT_HASH, reuse)
        self.reused_blocks += reuse
        if out:
            # the chain a later prompt will compare against; one this chain extends is dropped
            kept = [e for e in self._entries if not (e[1] is best and reuse == len(best))]
            self._entries = [(arr[:len(out) * bs + la], out)] + kept[:self.size - 1]
        return list(out)


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int = 0                 # tokens restored (a multiple of the block size)
    blocks: tuple[int, ...] = ()        # cached KV blocks of those tokens
    row: int = -1                       # checkpoint row restored into the slot (-1: none)
    shared_tokens: int = 0              # tokens whose KV blocks are all cached (>= num_tokens)


NO_HIT = PrefixHit()


@dataclass
class _Pending:
    """What a scheduled prefill chunk will have computed once its step commits."""
    step_id: int
    req: Request
    epoch: int
    kv: list[tuple[int, bytes]] = field(default_factory=list)      # (block index in req, hash)
    saves: list[tuple[bytes, int]] = field(default_factory=list)   # (hash, checkpoint row)
    chain: list[bytes] = field(default_factory=list)   # checkpoints it saves or passes, shallow first


class NoPrefixCache:
    """Prefix caching off: no hits, no saves."""
    enabled = False

    def begin_step(self) -> None:
        pass

    def match(self, req: Request, target: int) -> PrefixHit:
        return NO_HIT

    def num_unreferenced(self, hit: PrefixHit) -> int:
        return 0

    def take(self, req: Request, hit: PrefixHit) -> None:
        req.num_cached_tokens = 0

    def plan_chunk(self, req: Request, start: int, n: int, step_id: int) -> tuple:
        return ()

    def commit(self, step_id: int) -> None:
        pass

    def drop(self, req: Request) -> None:
        pass

    def stats(self) -> dict:
        return {}

    def reset_counters(self) -> None:
        pass


class PrefixCache(NoPrefixCache):
    enabled = True

    def __init__(self, *, block_size: int, interval_blocks: int, lookahead: int,
                 blocks: CachingBlockAllocator, num_rows: int):
        self.block_size, self.interval, self.lookahead = block_size, interval_blocks, lookahead
        self.blocks = blocks
        self.index = CheckpointIndex(num_rows)
        blocks.on_evict = self.index.drop          # a checkpoint without its KV blocks is unreachable
        self._pending: list[_Pending] = []
        self._restoring: list[tuple[Request, int]] = []   # (request, row) pinned by a restore not yet launched
        self._kv_upto: dict[str, int] = {}         # req id -> blocks already planned for registration
        self._divergence: dict[str, int] = {}      # req id -> boundary past its restore to save at
        self._chain_end: dict[str, bytes] = {}     # req id -> its deepest checkpoint restored, saved or passed
        self.recent = RecentChains(block_size, lookahead)   # prompts' chains, reused by prompts sharing a prefix
        self.queries = self.hits = self.query_tokens = self.hit_tokens = 0

    # ---- hashes -----------------------------------------------------------------------------
    def hashes(self, req: Request) -> list[bytes]:
        """The request's chain over its current tokens (extended as outputs arrive; cached)."""
        tokens = req.all_token_ids
        hs = req.block_hashes
        if (len(hs) + 1) * self.block_size + self.lookahead <= len(tokens):
            if hs:                                  # outputs arrived: extend the request's own chain
                hs.extend(hash_blocks(tokens, self.block_size, self.lookahead, hs[-1], len(hs)))
            else:                                   # a prompt: recent prompts may share its prefix
                hs.extend(self.recent.chain(tokens))
        return hs

    def is_boundary(self, q: int, target: int) -> bool:
        """Checkpoints are saved at these token counts: every ``interval`` blocks, and the last
        full block of the prefill target whose hash is known (the next turn of a chat resumes
        there). With the MTP lookahead a block's hash needs the token after it, so a target that
        ends on a block boundary saves one block earlier: without that its turn saved no end at
        all, and the next turn restored a turn further back."""
        bs = self.block_size
        return q > 0 and q % bs == 0 and (q % (self.interval * bs) == 0 or q == (target - self.lookahead) // bs * bs)

    # ---- admission ----------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A new step is being scheduled: the restores of the previous one were launched, and
        later device work is ordered after them, so their rows may be evicted again."""
        for _, row in self._restoring:
            self.index.unpin(row)
        self._restoring.clear()

    def match(self, req: Request, target: int) -> PrefixHit:
        hs = self.hashes(req)
        bs = self.block_size
        cached = self.blocks.lookup(hs[:max(target - 1, 0) // bs])          # q <= target - 1
        shared = len(cached) * bs
        for k in range(len(cached), 0, -1):
            row = self.index.get(hs[k - 1])
            if row is not None:
                return PrefixHit(k * bs, tuple(cached[:k]), row, shared)
        return PrefixHit(shared_tokens=shared) if shared else NO_HIT

    def num_unreferenced(self, hit: PrefixHit) -> int:
        return self.blocks.num_unreferenced(hit.blocks)

    def take(self, req: Request, hit: PrefixHit) -> None:
        """``req`` is admitted with ``hit``: reference its blocks, pin its checkpoint row until
        the restore is launched, count the query."""
        self.queries += 1
        self.query_tokens += req.num_tokens
        req.num_cached_tokens = hit.num_tokens
        self._kv_upto[req.request_id] = len(hit.blocks)
        if hit.shared_tokens > hit.num_tokens:        # (drop() forgets it when the request leaves)
            self._divergence[req.request_id] = hit.shared_tokens
        self._chain_end.pop(req.request_id, None)
        if hit.num_tokens:
            self._chain_end[req.request_id] = req.block_hashes[hit.num_tokens // self.block_size - 1]
            self.hits += 1
            self.hit_tokens += hit.num_tokens
            self.blocks.take(hit.blocks)
            self.index.pin(hit.row)
            self.index.touch(hit.row)
            self._restoring.append((req, hit.row))

    # ---- prefill chunks ---------------------------------------------------------------------
    def plan_chunk(self, req: Request, start: int, n: int, step_id: int) -> tuple[tuple[int, int], ...]:
        """A prefill chunk [start, start+n) of ``req`` is scheduled in step ``step_id``: the
        checkpoint saves it makes ((boundary q, row) pairs, for the step's metadata) and the KV
        blocks it completes, both published when the step commits."""
        hs, bs, end, target = req.block_hashes, self.block_size, start + n, req.prefill_target
        entry = _Pending(step_id, req, req.epoch)
        first = self._kv_upto.get(req.request_id, 0)
        last = min(end // bs, len(hs))
        entry.kv = [(k, hs[k]) for k in range(first, last)]
        self._kv_upto[req.request_id] = max(first, last)
        saves = []
        diverge = self._divergence.get(req.request_id, -1)
        for q in range((start // bs + 1) * bs, end + 1, bs):
            if q // bs > len(hs) or not (q == diverge or self.is_boundary(q, target)):
                continue
            h = hs[q // bs - 1]
            have = self.index.get(h)
            if have is not None:
                self.index.touch(have)
                entry.chain.append(h)
                continue
            row = self.index.allocate()
            if row is None:
                continue                              # every row pinned: skip this checkpoint
            entry.saves.append((h, row))
            entry.chain.append(h)
            saves.append((q, row))
        if entry.kv or entry.saves or entry.chain:
            self._pending.append(entry)
        return tuple(saves)

    def commit(self, step_id: int) -> None:
        """Step ``step_id``'s output arrived: publish what its chunks computed. Entries of older
        steps (a step that failed) are discarded."""
        self.begin_step()                            # step_id and every earlier step were launched
        keep = []
        for e in self._pending:
            if e.step_id > step_id:
                keep.append(e)
                continue
            live = (e.step_id == step_id and e.req.epoch == e.epoch and e.req.status is Status.RUNNING)
            for k, h in e.kv:
                if live:
                    self.blocks.register(e.req.block_ids[k], h)
            for h, row in e.saves:
                if live:
                    self.index.commit(row, h)
                else:
                    self.index.discard(row)
            if live:
                self._extend_chain(e.req.request_id, e.chain)
        self._pending = keep

    def _extend_chain(self, req_id: str, chain: list[bytes]) -> None:
        """The request's chain went on through these checkpoints (shallow first): each one
        continues the previous one (``CheckpointIndex.continued``: the eviction order)."""
        end = self._chain_end.get(req_id)
        for h in chain:
            if end is not None:
                self.index.continued(end, h)
            end = h
        if end is not None:
            self._chain_end[req_id] = end

    def drop(self, req: Request) -> None:
        """``req`` left the running set (finished, aborted, failed, preempted): its saves in flight
        are never published."""
        self._kv_upto.pop(req.request_id, None)
        self._divergence.pop(req.request_id, None)
        self._chain_end.pop(req.request_id, None)
        for r, row in [x for x in self._restoring if x[0] is req]:
            self.index.unpin(row)
            self._restoring.remove((r, row))
        keep = []
        for e in self._pending:
            if e.req is req:
                for _, row in e.saves:
                    self.index.discard(row)
            else:
                keep.append(e)
        self._pending = keep

    def reset_counters(self) -> None:
        """Queries and hits back to zero (the cached blocks and checkpoints stay)."""
        self.queries = self.hits = self.query_tokens = self.hit_tokens = 0

    def stats(self) -> dict:
        ix = self.index
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_query_tokens": self.query_tokens, "prefix_cache_hit_tokens": self.hit_tokens,
                "prefix_cache_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
                "prefix_cache_cached_blocks": self.blocks.num_cached,
                "prefix_cache_block_evictions": self.blocks.num_evictions,
                "mamba_checkpoints_used": ix.num_used, "mamba_checkpoints_total": ix.num_rows,
                "mamba_checkpoint_evictions": ix.num_evictions,
                "mamba_checkpoints_straight": ix.num_straight}
