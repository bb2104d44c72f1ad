"""A prefill-only step staged into its graph's arena (hybrid_engine/step/prefill_staging.py) leaves
exactly what ``load_prefill`` leaves in the static buffers, and its ForwardBatch view equals the
staged batch MixedPlan would have built."""
import itertools

import numpy as np
import pytest
import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
from hybrid_engine.step.prefill_layout import PrefillKey, load_prefill, static_prefill_batch
from hybrid_engine.step.prefill_staging import PrefillHost, in_arena

MAX_BLOCKS, MAX_LEN = 9, 144
i64 = lambda v: torch.tensor(v, dtype=torch.int64)   # noqa: E731


def _step(rng, t: int, cols: int, restore: bool, saves: int, logits: bool, start: int):
    """A random prefill-only step of t tokens as host arrays and as the batch MixedPlan stages."""
    ids = rng.integers(3, 1000, t).astype(np.int64)
    pos = np.arange(start, start + t, dtype=np.int64)
    slots = rng.integers(1, 500, t).astype(np.int64)
    bt = rng.integers(1, 60, cols).astype(np.int32)
    slot = int(rng.integers(1, 7))
    tokens = np.sort(rng.choice(t, saves, replace=False)).astype(np.int64) if saves else np.zeros(0, np.int64)
    rows = rng.integers(0, 30, saves).astype(np.int64)
    rest = (int(rng.integers(1, 7)), int(rng.integers(0, 30))) if restore else None
    h = PrefillHost(input_ids=ids, positions=pos, slot_mapping=slots, block_table=bt, seq_len=start + t, slot=slot,
                    has_initial_state=start > 0, restore=rest, ckpt_token=tokens, ckpt_rows=rows, logits=logits)
    fb = ForwardBatch(
        input_ids=torch.from_numpy(ids), positions=torch.from_numpy(pos),
        attn=AttnMetadata(query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                          seq_lens=torch.tensor([start + t], dtype=torch.int32),
                          block_tables=torch.from_numpy(bt)[None], slot_mapping=torch.from_numpy(slots),
                          max_query_len=t, max_seq_len=start + t),
        mamba=MambaMetadata(num_decode_rows=0, decode_len=1, decode_slots=i64([]), num_accepted=i64([]),
                            prefill_query_start_loc=i64([0, t]), prefill_qsl_cpu=(0, t), prefill_slots=i64([slot]),
                            has_initial_state=torch.tensor([start > 0]),
                            restore_slots=i64([rest[0]]) if restore else None,
                            restore_rows=i64([rest[1]]) if restore else None,
                            ckpt_seq=torch.zeros(saves, dtype=torch.int64) if saves else None,
                            ckpt_token=torch.from_numpy(tokens) if saves else None,
                            ckpt_rows=torch.from_numpy(rows) if saves else None),
        logits_indices=i64([t - 1] if logits else []))
    return h, fb


def _fields(fb):
    a, m = fb.attn, fb.mamba
    return {"input_ids": fb.input_ids, "positions": fb.positions, "logits_indices": fb.logits_indices,
            "qsl": a.query_start_loc, "seq_lens": a.seq_lens, "block_tables": a.block_tables,
            "slot_mapping": a.slot_mapping, "decode_slots": m.decode_slots, "num_accepted": m.num_accepted,
            "prefill_qsl": m.prefill_query_start_loc, "prefill_slots": m.prefill_slots,
            "init": m.has_initial_state, "restore_slots": m.restore_slots, "restore_rows": m.restore_rows,
            "ckpt_seq": m.ckpt_seq, "ckpt_token": m.ckpt_token, "ckpt_rows": m.ckpt_rows}


@pytest.mark.parametrize("pad_restores, restore, saves, logits",
                         list(itertools.product((False, True), (False, True), (0, 1, 3), (False, True))))
def test_staged_image_equals_load_prefill(pad_restores, restore, saves, logits):
    """For every key shape (restores padded or not, 0/1/3 saves, logits or not) and a few token
    counts and block-table widths: the arena after one copy of the host image equals a fresh
    static batch after load_prefill, word for word; the step's view equals the staged batch, with
    the same key, and aliases the static buffers (so the forward skips the copies)."""
    rng = np.random.default_rng(saves * 4 + 2 * restore + logits + 8 * pad_restores)
    for t, cols, start in ((5, 2, 0), (16, 4, 32), (31, 9, 80), (1, 1, 7)):
        if saves > t:
            continue
        h, fb = _step(rng, t, cols, restore, saves, logits, start)
        key = PrefillKey.of(fb, 2048, pad_restores=pad_restores)
        assert key == PrefillKey.prefill_only(t, restores=int(restore), saves=saves, logits=int(logits),
                                              max_tokens=2048, pad_restores=pad_restores)
        ref = in_arena(key, static_prefill_batch(key, max_blocks=MAX_BLOCKS, max_model_len=MAX_LEN,
                                                  device=torch.device("cpu")))
        load_prefill(ref.fb, fb)
        st = in_arena(key, static_prefill_batch(key, max_blocks=MAX_BLOCKS, max_model_len=MAX_LEN,
                                                 device=torch.device("cpu")))
        image = np.full(st.arena.numel(), -9, dtype=np.int64)   # the ring slot: garbage from earlier steps
        st.write(image, h)
        st.arena.copy_(torch.from_numpy(image))
        assert torch.equal(st.arena, ref.arena), (t, key)
        view = st.view(h, decode_len=1, num_accepted=i64([]))
        assert view.input_ids.data_ptr() == st.fb.input_ids.data_ptr()    # what lets the forward skip copies
        assert PrefillKey.of(view, 2048, pad_restores=pad_restores) == key
        assert view.mamba.prefill_qsl_cpu == (0, t) and view.attn.max_query_len == t
        assert view.attn.max_seq_len == start + t
        for name, a in _fields(view).items():
            b = _fields(fb)[name]
            assert (a is None) == (b is None), name
            assert a is None or (a.dtype == b.dtype and torch.equal(a, b)), (name, a, b)


def test_arena_views_share_one_buffer_and_keep_the_static_values():
    """in_arena moves every tensor of a static batch into one int64 buffer: writes through a
    field land in the arena, and the values (pad row at NULL_SLOT, its bounds) are unchanged."""
    key = PrefillKey(bucket=32, restores=1, saves=2, logits=1)
    fb = static_prefill_batch(key, max_blocks=MAX_BLOCKS, max_model_len=MAX_LEN, device=torch.device("cpu"))
    st = in_arena(key, fb)
    for name, a in _fields(st.fb).items():
        b = _fields(fb)[name]
        assert (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and torch.equal(a, b))), name
    assert st.fb.mamba.prefill_slots.tolist() == [NULL_SLOT, NULL_SLOT]
    assert st.fb.mamba.prefill_query_start_loc.tolist() == [0, 0, 32]
    base, end = st.arena.data_ptr(), st.arena.data_ptr() + st.arena.numel() * 8
    for name, a in _fields(st.fb).items():
        if a is not None and a.numel():
            assert base <= a.data_ptr() < end, name
    st.fb.attn.slot_mapping[3] = 12345
    assert (st.arena == 12345).sum() == 1


def test_staged_steps_on_a_reused_arena_match_load_prefill_past_the_pad_ids():
    """Steps of one key one after the other (long, short, a restore, none), each written over the
    previous one: every field equals load_prefill's on its own reused static batch, except the pad
    tokens' ids and positions (load_prefill leaves the previous step's there, the image zeros);
    a step that does not fit the key is refused."""
    rng = np.random.default_rng(11)
    key = PrefillKey(bucket=32, restores=1, saves=2, logits=1)
    ref = in_arena(key, static_prefill_batch(key, max_blocks=MAX_BLOCKS, max_model_len=MAX_LEN,
                                              device=torch.device("cpu")))
    st = in_arena(key, static_prefill_batch(key, max_blocks=MAX_BLOCKS, max_model_len=MAX_LEN,
                                             device=torch.device("cpu")))
    for t, cols, restore, saves, start in ((31, 9, True, 2, 16), (17, 3, False, 1, 0), (23, 5, True, 1, 40),
                                            (20, 6, False, 2, 8)):
        h, fb = _step(rng, t, cols, restore, saves, True, start)
        assert PrefillKey.of(fb, 2048, pad_restores=True) == key
        load_prefill(ref.fb, fb)
        image = np.full(st.arena.numel(), -9, dtype=np.int64)
        st.write(image, h)
        st.arena.copy_(torch.from_numpy(image))
        for name, a in _fields(st.fb).items():
            b = _fields(ref.fb)[name]
            if name in ("input_ids", "positions"):
                assert torch.equal(a[:t], b[:t]) and not a[t:].any(), name
            else:
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (t, name)
    h, _ = _step(rng, 32, 2, False, 0, True, 0)
    with pytest.raises(ValueError, match="does not fit"):
        st.write(np.zeros(st.arena.numel(), dtype=np.int64), h)
    h, _ = _step(rng, 8, MAX_BLOCKS + 1, False, 0, True, 0)
    with pytest.raises(ValueError, match="does not fit"):
        st.write(np.zeros(st.arena.numel(), dtype=np.int64), h)
