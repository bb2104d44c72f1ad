"""The layout of a prefill CUDA graph (``prefill_graphs``): its key, its padded static batch and
the copy of a real step into it.

Restores and saves are padded so that few keys exist (each new key costs a capture, ~0.1 s on the
8B shape, while requests wait): with checkpoint
storage every step restores one row (a step with none has a padding restore, row -1, which the
restore kernel skips), and a step that saves saves a power of two times, at least twice, by
repeating its last save (the same values into the same row). A chat turn saves once or twice
(where the request diverges from the cached blocks, and at its prompt's last full block), so its
steps share one key per bucket, which the start-up warm-up's single saves capture. Every host
number the kernels size their grids by is fixed by the key:

- the pad tokens ``T..bucket-1`` form a second Mamba row at ``NULL_SLOT`` that starts fresh
  (zeros in, nothing stored: the pool contract), so every Mamba kernel computes finite values
  there and the chunk count bound ``bucket / chunk + 2`` holds whatever ``T`` is;
- attention sees the decode rows and one prefill row; tokens past its ``query_start_loc`` are
  graph padding (zero output), and the pad tokens write the null KV block (slot 0), as decode
  graphs' pad rows do;
- pad decode rows are a decode graph's pad rows: ``NULL_SLOT`` (no state read or written), the
  null block, accepted count 1;
- ``max_query_len`` is the bucket and ``max_seq_len`` the model length: upper bounds (the kernels
  stop at the device lengths).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hybrid_engine.mamba_cache import NULL_SLOT

from .forward_batch import AttnMetadata, ForwardBatch, MambaMetadata


def prefill_bucket(num_tokens: int) -> int:
    """The graph size for a prefill of ``num_tokens``: the smallest multiple of
    ``max(16, p / 16)`` above ``num_tokens``, p the largest power of two <= num_tokens + 1 (at
    least one pad token; at most max(16, (num_tokens + 1) / 16) of them: the pad tokens cost GPU
    time, the sizes captures)."""
    n = num_tokens + 1
    step = max(16, (1 << (n.bit_length() - 1)) // 16)
    return -(-n // step) * step


def mixed_decode_buckets(decode_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The decode-row counts a mixed graph is captured for, from the decode graphs' buckets: 4, 16,
    64 and 256 where they are buckets, and the largest. Coarse on purpose: each count multiplies the
    keys (captures), while a pad decode row costs a step little (one token in the GEMMs; the Mamba
    and attention kernels skip its NULL_SLOT state and null block)."""
    if not decode_buckets:
        return ()
    return tuple(sorted({b for b in decode_buckets if b in (4, 16, 64, 256)} | {max(decode_buckets)}))


@dataclass(frozen=True)
class PrefillKey:
    bucket: int       # padded prefill tokens (> the step's prefill tokens)
    restores: int     # prefix-cache restores before the forward (0 or 1)
    saves: int        # Mamba checkpoint saves in the chunk (0, or padded: 2, 4, 8, ...)
    logits: int       # prefill rows whose logits are computed (1 on a request's last chunk, else 0)
    decode_rows: int = 0   # a mixed step's decode rows, padded to a ``mixed_decode_buckets`` count (0: none)
    decode_len: int = 1    # tokens per decode row (1 + K)

    @classmethod
    def of(cls, fb: ForwardBatch, max_tokens: int, *, pad_restores: bool = False,
           decode_buckets: tuple[int, ...] = ()) -> "PrefillKey | None":
        """The key of a qualifying step, else None. ``pad_restores`` (the model has checkpoint
        storage): every key restores one row, so a step without a restore shares its graph.
        ``decode_buckets`` (ascending): a step with decode rows qualifies when they fit the
        largest (a mixed graph); without them it does not."""
        md = fb.mamba
        nd = md.num_decode_rows
        num_tokens = fb.input_ids.shape[0] - md.num_decode_tokens          # the prefill row's
        if md.num_prefill_rows != 1 or not 0 < num_tokens <= max_tokens:
            return None
        if nd and not (decode_buckets and nd <= decode_buckets[-1]):
            return None
        n = lambda t: 0 if t is None else t.shape[0]      # noqa: E731
        return cls(bucket=prefill_bucket(num_tokens), restores=1 if pad_restores else n(md.restore_rows),
                   saves=_padded_saves(n(md.ckpt_rows)),
                   logits=fb.logits_indices.shape[0] - md.num_decode_tokens,
                   decode_rows=next(b for b in decode_buckets if b >= nd) if nd else 0,
                   decode_len=md.decode_len if nd else 1)

    @classmethod
    def prefill_only(cls, num_tokens: int, *, restores: int, saves: int, logits: int, max_tokens: int,
                     pad_restores: bool = False) -> "PrefillKey | None":
        """``of`` a step of one prefill row and no decode rows, from its host counts (restores,
        checkpoint saves, logits rows: 0 or 1), before its batch exists."""
        if not 0 < num_tokens <= max_tokens:
            return None
        return cls(bucket=prefill_bucket(num_tokens), restores=1 if pad_restores else restores,
                   saves=_padded_saves(saves), logits=logits)

    @property
    def decode_tokens(self) -> int:
        return self.decode_rows * self.decode_len


def _padded_saves(saves: int) -> int:
    """A step's checkpoint saves as its key counts them: 0, or the next power of two >= 2."""
    return saves and max(2, 1 << (saves - 1).bit_length())


def static_prefill_batch(key: PrefillKey, *, max_blocks: int, max_model_len: int,
                         device: torch.device) -> ForwardBatch:
    """The persistent input buffers of ``key``'s graph (``load_prefill`` fills them). A mixed key's
    ``decode_rows`` rows come first (``decode_len`` tokens each; pad rows as a decode graph's: the
    NULL_SLOT state, the null block, accepted count 1), then the prefill row and its pad tokens."""
    tb, nd, s = key.bucket, key.decode_rows, key.decode_len
    td = nd * s
    i64 = lambda n: torch.zeros(n, dtype=torch.int64, device=device)     # noqa: E731
    opt = lambda n: i64(n) if n else None                                # noqa: E731
    # decode rows' starts (fixed: every row has s tokens), the prefill row's start, its end (loaded)
    qsl = torch.cat([torch.arange(nd + 1, dtype=torch.int32, device=device) * s,
                     torch.full((1,), td, dtype=torch.int32, device=device)])
    attn = AttnMetadata(query_start_loc=qsl,
                        seq_lens=torch.full((nd + 1,), s, dtype=torch.int32, device=device),
                        block_tables=torch.zeros(nd + 1, max_blocks, dtype=torch.int32, device=device),
                        slot_mapping=i64(td + tb), max_query_len=tb,
                        # decode rows may reach 2s past the model length mid-verify (as in decode graphs)
                        max_seq_len=max_model_len + (2 * s if nd else 0))
    mamba = MambaMetadata(
        num_decode_rows=nd, decode_len=s, decode_slots=torch.full((nd,), NULL_SLOT, dtype=torch.int64, device=device),
        num_accepted=torch.ones(nd, dtype=torch.int64, device=device),
        prefill_query_start_loc=torch.tensor([0, 0, tb], dtype=torch.int64, device=device),   # [real, pad]
        prefill_qsl_cpu=(0, tb - 1, tb),            # host bounds only: two rows, none longer than tb - 1
        prefill_slots=torch.full((2,), NULL_SLOT, dtype=torch.int64, device=device),
        has_initial_state=torch.zeros(2, dtype=torch.bool, device=device),
        restore_slots=opt(key.restores), restore_rows=opt(key.restores),
        ckpt_seq=opt(key.saves), ckpt_token=opt(key.saves), ckpt_rows=opt(key.saves))
    # decode tokens' logits (every one), then the prefill row's (loaded)
    logits_indices = torch.cat([torch.arange(td, dtype=torch.int64, device=device), i64(key.logits)])
    return ForwardBatch(input_ids=i64(td + tb), positions=i64(td + tb), attn=attn, mamba=mamba,
                        logits_indices=logits_indices)


def load_prefill(dst: ForwardBatch, src: ForwardBatch, *, harmless: bool = False) -> None:
    """Copy a qualifying step's batch ``src`` into the static buffers ``dst`` of its key (device
    copies, no sync). A mixed step's decode rows go first, its pad decode rows after them; the
    prefill row starts at the key's ``decode_tokens``. Pad tokens write the null KV block.
    ``harmless``: the capture's warm-up copy (Mamba rows, decode slots and restores at NULL_SLOT,
    every KV write in the null block, nothing continuing an earlier chunk)."""
    sm, dm = src.mamba, dst.mamba
    nd, nd_pad, s = sm.num_decode_rows, dm.num_decode_rows, dm.decode_len
    td, td_pad = sm.num_decode_tokens, dm.num_decode_tokens
    num_tokens = src.input_ids.shape[0] - td                        # the prefill row's
    end = td_pad + num_tokens
    for d, x in ((dst.input_ids, src.input_ids), (dst.positions, src.positions)):
        d[:td].copy_(x[:td])
        d[td_pad:end].copy_(x[td:])
    dst.input_ids[td:td_pad].zero_()                                # pad decode rows: token 0
    da, sa = dst.attn, src.attn
    da.query_start_loc[-1:].fill_(end)                               # the rest is fixed by the key
    da.seq_lens[nd:nd_pad].fill_(s)
    da.seq_lens[:nd].copy_(sa.seq_lens[:nd])
    da.seq_lens[nd_pad:].copy_(sa.seq_lens[nd:])
    cols = sa.block_tables.shape[1]
    da.block_tables[:, cols:].zero_()
    da.block_tables[nd:nd_pad].zero_()                               # pad decode rows read the null block
    da.block_tables[:nd, :cols].copy_(sa.block_tables[:nd])
    da.block_tables[nd_pad:, :cols].copy_(sa.block_tables[nd:])
    if harmless:
        da.slot_mapping.zero_()
    else:
        da.slot_mapping[:td].copy_(sa.slot_mapping[:td])
        da.slot_mapping[td:td_pad].zero_()                           # pad tokens write the null block
        da.slot_mapping[td_pad:end].copy_(sa.slot_mapping[td:])
        da.slot_mapping[end:].zero_()
    if nd_pad:
        if harmless:
            dm.decode_slots.fill_(NULL_SLOT)
        else:
            dm.decode_slots[:nd].copy_(sm.decode_slots)
            dm.decode_slots[nd:].fill_(NULL_SLOT)
        dm.num_accepted[:nd].copy_(sm.num_accepted)
        dm.num_accepted[nd:].fill_(1)
    dm.prefill_query_start_loc[:2].copy_(sm.prefill_query_start_loc)
    if harmless:
        dm.prefill_slots[:1].fill_(NULL_SLOT)
        dm.has_initial_state[:1].fill_(False)
    else:
        dm.prefill_slots[:1].copy_(sm.prefill_slots)
        dm.has_initial_state[:1].copy_(sm.has_initial_state)
    if dm.restore_rows is not None:
        if sm.restore_rows is None:        # the padded restore: row -1 (skipped) at NULL_SLOT
            dm.restore_rows.fill_(-1)
            dm.restore_slots.fill_(NULL_SLOT)
        else:
            dm.restore_rows.copy_(sm.restore_rows)
            if harmless:
                dm.restore_slots.fill_(NULL_SLOT)
            else:
                dm.restore_slots.copy_(sm.restore_slots)
    if dm.ckpt_rows is not None:
        saves = sm.ckpt_rows.shape[0]
        for name in ("ckpt_seq", "ckpt_token", "ckpt_rows"):
            d, x = getattr(dm, name), getattr(sm, name)
            d[:saves].copy_(x)
            if saves < d.shape[0]:         # the padded saves repeat the last one (same values, same row)
                d[saves:].copy_(x[saves - 1:].expand(d.shape[0] - saves))
    # the decode tokens' logits are static (every decode token); the prefill row's move by the padding
    li = src.logits_indices[td:]
    dst.logits_indices[td_pad:].copy_(li if td == td_pad else li + (td_pad - td))


def split_decode_prefill(fb: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
    """A step of decode/verify rows and one prefill row -> (its decode rows, its prefill row), each
    a ForwardBatch of its own (views, plus two small device ops for the prefill row's offsets).
    The two touch disjoint Mamba slots and KV blocks, so they may run one after the other."""
    md, a = fb.mamba, fb.attn
    nd, td = md.num_decode_rows, md.num_decode_tokens
    empty_i64 = md.decode_slots[:0]
    dec = ForwardBatch(
        input_ids=fb.input_ids[:td], positions=fb.positions[:td],
        attn=AttnMetadata(query_start_loc=a.query_start_loc[:nd + 1], seq_lens=a.seq_lens[:nd],
                          block_tables=a.block_tables[:nd], slot_mapping=a.slot_mapping[:td],
                          max_query_len=md.decode_len, max_seq_len=a.max_seq_len),
        mamba=MambaMetadata(num_decode_rows=nd, decode_len=md.decode_len, decode_slots=md.decode_slots,
                            num_accepted=md.num_accepted, prefill_query_start_loc=md.prefill_query_start_loc[:1],
                            prefill_qsl_cpu=(0,), prefill_slots=md.prefill_slots[:0],
                            has_initial_state=md.has_initial_state[:0]),
        logits_indices=fb.logits_indices[:td])
    pre = ForwardBatch(
        input_ids=fb.input_ids[td:], positions=fb.positions[td:],
        attn=AttnMetadata(query_start_loc=a.query_start_loc[nd:] - td, seq_lens=a.seq_lens[nd:],
                          block_tables=a.block_tables[nd:], slot_mapping=a.slot_mapping[td:],
                          max_query_len=md.max_prefill_len, max_seq_len=a.max_seq_len),
        mamba=replace(md, num_decode_rows=0, decode_slots=empty_i64, num_accepted=empty_i64),
        logits_indices=fb.logits_indices[td:] - td)
    return dec, pre
