"""Prefill graphs on CPU (hybrid_engine/step/prefill_graphs.py): the padded static batch a graph
replays, and the capture's warm-up, through the engine. On CPU the graph is replaced by an eager
rerun of the forward on the static buffers (``RerunPrefillGraphs``), so everything but the CUDA
capture itself runs here: bucketing, padding (a NULL_SLOT Mamba row, tokens past attention's
last row), the copy-in of each step, the harmless warm-up. The CUDA replay is
tests/gpu/test_prefill_graphs_cuda.py.
"""
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.step.prefill_layout import PrefillKey, prefill_bucket
from hf_reference import hf_greedy
from prefill_graph_harness import RerunPrefillGraphs, install_reruns, small_engine

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")


def test_prefill_bucket_pads_at_least_one_token_and_at_most_a_sixteenth():
    prev = 0
    for n in range(1, 5000):
        b = prefill_bucket(n)
        assert b > n and b % 16 == 0 and b >= prev
        assert b - n <= max(16, (n + 1) / 16), (n, b)
        prev = b
    assert prefill_bucket(300) == 304 and prefill_bucket(600) == 608 and prefill_bucket(15) == 16 and prefill_bucket(16) == 32


@pytest.mark.parametrize("async_scheduling, spec", [(True, None), (False, None), (True, "mtp"), (True, "ngram")])
def test_one_request_prefills_replay_padded_and_match_transformers(hybrid_dir, async_scheduling, spec):
    """A conversation one turn at a time (each turn a prefill-only step of one request: chunks
    that save checkpoints, turns that restore one) through padded static batches: greedy tokens
    equal transformers', and every capture's warm-up left the caches alone. With MTP the drafter
    reads the replayed hidden states of every prefill token."""
    from hybrid_engine import SpeculativeConfig
    llm = small_engine(hybrid_dir, async_scheduling=async_scheduling,
                       speculative_config=None if spec is None else SpeculativeConfig(spec, 2))
    pg = install_reruns(llm)
    rng = np.random.default_rng(3)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    convo = rng.integers(3, 256, 21).tolist()
    cached = []
    for turn in range(7):
        prompt = convo + rng.integers(3, 256, int(rng.integers(2, 12))).tolist()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(hybrid_dir, [prompt], 3)[0], f"turn {turn}"
        cached.append(out.num_cached_tokens)
        convo = prompt + out.outputs[0].token_ids
    keys = [k for k, _ in pg.captured]
    assert all(not bad for _, bad in pg.captured), pg.captured
    assert all(k.restores == 1 for k in keys) and any(k.saves for k in keys), keys   # restores padded
    assert {k.logits for k in keys} == {0, 1}, keys
    assert pg.replays > len(keys) and sum(c > 0 for c in cached) >= 5, (pg.replays, cached)
    # each key's first step captured from a staged batch; every later one was staged into the arena
    assert pg.staged_steps == pg.replays - len(keys) > 0, (pg.staged_steps, pg.replays, len(keys))


def test_split_decode_prefill_views_each_part_in_its_own_offsets():
    """Two verify rows of 3 tokens, then a prefill row of 5 tokens that restores and saves: the
    decode part keeps the first rows and tokens; the prefill part's query and logits offsets
    start at its first token."""
    from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
    from hybrid_engine.step.prefill_layout import split_decode_prefill
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)   # noqa: E731
    attn = AttnMetadata(torch.tensor([0, 3, 6, 11], dtype=torch.int32), torch.tensor([9, 12, 25], dtype=torch.int32),
                        torch.arange(12, dtype=torch.int32).view(3, 4), i64(list(range(50, 61))), 5, 25)
    mamba = MambaMetadata(2, 3, i64([4, 6]), i64([1, 2]), i64([0, 5]), (0, 5), i64([8]), torch.tensor([True]),
                          restore_slots=i64([8]), restore_rows=i64([3]), ckpt_seq=i64([0]), ckpt_token=i64([2]),
                          ckpt_rows=i64([7]))
    fb = ForwardBatch(i64(list(range(100, 111))), i64(list(range(200, 211))), attn, mamba, i64([0, 1, 2, 3, 4, 5, 10]))
    dec, pre = split_decode_prefill(fb)
    assert dec.input_ids.tolist() == list(range(100, 106)) and pre.input_ids.tolist() == list(range(106, 111))
    assert dec.attn.query_start_loc.tolist() == [0, 3, 6] and pre.attn.query_start_loc.tolist() == [0, 5]
    assert dec.attn.seq_lens.tolist() == [9, 12] and pre.attn.seq_lens.tolist() == [25]
    assert dec.attn.block_tables.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and pre.attn.block_tables.tolist() == [[8, 9, 10, 11]]
    assert dec.attn.slot_mapping.tolist() == list(range(50, 56)) and pre.attn.slot_mapping.tolist() == list(range(56, 61))
    assert (dec.attn.max_query_len, pre.attn.max_query_len) == (3, 5)
    assert dec.mamba.num_decode_rows == 2 and dec.mamba.num_prefill_rows == 0 and dec.mamba.num_accepted.tolist() == [1, 2]
    assert pre.mamba.num_decode_rows == 0 and pre.mamba.num_prefill_rows == 1 and pre.mamba.restore_rows.tolist() == [3]
    assert pre.mamba.ckpt_token.tolist() == [2] and pre.mamba.prefill_slots.tolist() == [8]
    assert dec.logits_indices.tolist() == [0, 1, 2, 3, 4, 5] and pre.logits_indices.tolist() == [4]
    assert PrefillKey.of(pre, 2048) == PrefillKey(bucket=16, restores=1, saves=2, logits=1)


def test_keys_pad_restores_to_one_and_saves_to_a_power_of_two():
    """Fewer keys, fewer captures: a step without a restore gets a padding restore (row -1,
    skipped by the restore, at NULL_SLOT; only where checkpoint storage exists), and 3 saves become
    4 by repeating the last one (same boundary, same row); one save becomes two."""
    from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
    from hybrid_engine.step.prefill_layout import load_prefill, static_prefill_batch
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)   # noqa: E731
    n = 10
    attn = AttnMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                        torch.arange(1, 4, dtype=torch.int32)[None], i64(list(range(100, 100 + n))), n, n)
    mamba = MambaMetadata(0, 1, i64([]), i64([]), i64([0, n]), (0, n), i64([3]), torch.tensor([False]),
                          ckpt_seq=i64([0, 0, 0]), ckpt_token=i64([3, 7, 9]), ckpt_rows=i64([5, 6, 2]))
    fb = ForwardBatch(i64(list(range(7, 7 + n))), i64(list(range(n))), attn, mamba, i64([n - 1]))
    assert PrefillKey.of(fb, 2048) == PrefillKey(bucket=16, restores=0, saves=4, logits=1)
    key = PrefillKey.of(fb, 2048, pad_restores=True)
    assert key == PrefillKey(bucket=16, restores=1, saves=4, logits=1)
    dst = static_prefill_batch(key, max_blocks=6, max_model_len=64, device=torch.device("cpu"))
    dst.mamba.restore_rows.fill_(9)
    load_prefill(dst, fb)
    m = dst.mamba
    assert m.restore_rows.tolist() == [-1] and m.restore_slots.tolist() == [NULL_SLOT]
    assert m.ckpt_token.tolist() == [3, 7, 9, 9] and m.ckpt_rows.tolist() == [5, 6, 2, 2]
    assert m.ckpt_seq.tolist() == [0, 0, 0, 0]
    one = replace_saves(fb, 1)
    assert PrefillKey.of(one, 2048).saves == 2 and PrefillKey.of(replace_saves(fb, 0), 2048).saves == 0
    dst1 = static_prefill_batch(PrefillKey.of(one, 2048), max_blocks=6, max_model_len=64, device=torch.device("cpu"))
    load_prefill(dst1, one)                      # one save, padded to two: the same save twice
    assert dst1.mamba.ckpt_token.tolist() == [3, 3] and dst1.mamba.ckpt_rows.tolist() == [5, 5]


def replace_saves(fb, k):
    from dataclasses import replace
    m = fb.mamba
    if k == 0:
        return replace(fb, mamba=replace(m, ckpt_seq=None, ckpt_token=None, ckpt_rows=None))
    return replace(fb, mamba=replace(m, ckpt_seq=m.ckpt_seq[:k], ckpt_token=m.ckpt_token[:k], ckpt_rows=m.ckpt_rows[:k]))


def test_load_prefill_pads_into_the_null_block_and_a_fresh_null_slot_row():
    """Loading a long step and then a short one of the same key: the short step's pad tokens
    write the null KV block (not the long step's slots), form a fresh NULL_SLOT Mamba row, and
    attention's one row ends at the real tokens."""
    from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
    from hybrid_engine.step.prefill_layout import load_prefill, static_prefill_batch

    def step(n, slot):
        i64 = lambda v: torch.tensor(v, dtype=torch.int64)   # noqa: E731
        attn = AttnMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([40 + n], dtype=torch.int32),
                            torch.arange(1, 4, dtype=torch.int32)[None], i64(list(range(100, 100 + n))), n, 40 + n)
        mamba = MambaMetadata(0, 1, i64([]), i64([]), i64([0, n]), (0, n), i64([slot]), torch.tensor([True]),
                              ckpt_seq=i64([0]), ckpt_token=i64([n - 2]), ckpt_rows=i64([5]))
        return ForwardBatch(i64(list(range(7, 7 + n))), i64(list(range(40, 40 + n))), attn, mamba, i64([n - 1]))

    long, short = step(13, 3), step(9, 2)
    key = PrefillKey.of(long, 2048)
    assert key == PrefillKey.of(short, 2048) == PrefillKey(bucket=16, restores=0, saves=2, logits=1)
    dst = static_prefill_batch(key, max_blocks=6, max_model_len=64, device=torch.device("cpu"))
    load_prefill(dst, long)
    load_prefill(dst, short)
    assert dst.attn.slot_mapping.tolist() == list(range(100, 109)) + [0] * 7
    assert dst.attn.query_start_loc.tolist() == [0, 9] and dst.attn.block_tables.tolist() == [[1, 2, 3, 0, 0, 0]]
    m = dst.mamba
    assert m.prefill_query_start_loc.tolist() == [0, 9, 16] and m.prefill_slots.tolist() == [2, NULL_SLOT]
    assert m.has_initial_state.tolist() == [True, False] and m.ckpt_token.tolist() == [7, 7]
    assert dst.logits_indices.tolist() == [8] and dst.input_ids[:9].tolist() == list(range(7, 16))
    load_prefill(dst, short, harmless=True)
    assert m.prefill_slots.tolist() == [NULL_SLOT] * 2 and not m.has_initial_state.any()
    assert not dst.attn.slot_mapping.any()
    assert PrefillKey.of(step(13, 3), 12) is None


def test_graph_output_buffers_grow_once_to_the_most_any_graph_needs():
    from hybrid_engine.step.prefill_graphs import _at_least
    like = torch.zeros(3, 5, dtype=torch.float16)
    first = _at_least(None, like, 3, 40)
    assert first.shape == (3, 5) and first.dtype == torch.float16          # prefill-only graphs need few
    assert _at_least(first, like[:2], 2, 40) is first
    grown = _at_least(first, torch.zeros(7, 5, dtype=torch.float16), 7, 40)
    assert grown.shape == (40, 5)                                          # the most, at once
    assert _at_least(grown, like, 39, 40) is grown and _at_least(grown, like, 50, 40).shape == (50, 5)


def test_warmup_check_catches_a_warmup_that_writes_the_real_slot(hybrid_dir, monkeypatch):
    """The harmless copy is what keeps the warm-up off the request's state: copying the real
    slots in for the warm-up is caught by the snapshot check above."""
    import hybrid_engine.step.prefill_graphs as pgm
    real = pgm.load_prefill
    monkeypatch.setattr(pgm, "load_prefill", lambda dst, src, harmless=False: real(dst, src))
    llm = small_engine(hybrid_dir)
    pg = install_reruns(llm)
    llm.generate([list(range(3, 30))], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert any(bad for _, bad in pg.captured)


def test_prefill_cuda_graphs_must_be_a_bool(hybrid_dir):
    with pytest.raises(TypeError, match="prefill_cuda_graphs must be a bool"):
        LLM(hybrid_dir, dtype="float32", device=DEV, prefill_cuda_graphs="yes")


def test_a_capture_out_of_memory_falls_back_to_eager_for_good(hybrid_dir, caplog):
    class NoMemory(RerunPrefillGraphs):
        def _record(self, fresh):
            self.tries = getattr(self, "tries", 0) + 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")

    llm = small_engine(hybrid_dir)
    pg = install_reruns(llm, cls=NoMemory)
    prompt = list(range(3, 30))
    out = llm.generate([prompt], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hybrid_dir, [prompt], 3)[0]
    assert pg.tries == 1 and not pg.graphs and "ran out of memory" in caplog.text


def test_a_failed_capture_runs_that_shape_eagerly_without_retrying(hybrid_dir, caplog):
    """A capture that raises (an op a CUDA graph does not allow, say) costs that step nothing but
    the attempt: the step runs eagerly, the key is never tried again, other keys still capture."""
    class FailsOnce(RerunPrefillGraphs):
        def _record(self, fresh):
            self.tries = getattr(self, "tries", 0) + 1
            if self.tries == 1:
                raise RuntimeError("operation not permitted when stream is capturing (test)")
            return super()._record(fresh)

    llm = small_engine(hybrid_dir)
    pg = install_reruns(llm, cls=FailsOnce)
    rng = np.random.default_rng(5)
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    for _ in range(3):
        prompt = rng.integers(3, 256, 30).tolist()
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(hybrid_dir, [prompt], 2)[0]
    failed = list(pg._failed)
    assert len(failed) == 1 and failed[0] not in pg.graphs and pg.graphs, (failed, list(pg.graphs))
    assert pg.tries == 1 + len(pg.graphs) and "capturing" in caplog.text and "failed" in caplog.text


def test_prompt_logprobs_read_every_replayed_hidden_state(hybrid_dir):
    """prompt_logprobs take the logits of every prompt position from the forward's hidden states:
    through padded replays (chunks of up to 12 tokens) they equal the plain engine's."""
    sp = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    prompt = np.random.default_rng(9).integers(3, 256, 29).tolist()
    got = {}
    for rerun in (False, True):
        llm = small_engine(hybrid_dir)
        pg = install_reruns(llm) if rerun else None
        got[rerun] = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert pg.replays >= 3
    a, b = got[True], got[False]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert len(a.prompt_logprobs) == len(prompt) and a.prompt_logprobs[0] is None
    for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
        assert pa.keys() == pb.keys()
        assert all(abs(pa[t] - pb[t]) < 1e-4 for t in pa)
