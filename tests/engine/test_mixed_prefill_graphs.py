"""Mixed prefill graphs on CPU (hybrid_engine/step/prefill_graphs.py, prefill_layout.py): a step of
decode rows and one prefill row replayed as one padded graph (the graph replaced by an eager rerun
of its static buffers, ``prefill_graph_harness``), or split into a prefill graph and the decode
rows. The CUDA replay is tests/gpu/test_prefill_graphs_cuda.py."""
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.step.prefill_layout import PrefillKey
from hf_reference import hf_greedy
from prefill_graph_harness import BS, install_reruns, serve_with_arrivals, small_engine

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")


def serve_four_arrivals(eng, hybrid_dir):
    """Four prompts over one system prompt, each arriving while another request decodes (steps of
    decode rows and a prefill row); greedy tokens equal transformers'."""
    rng = np.random.default_rng(12)
    system = rng.integers(3, 256, 17).tolist()
    prompts = [system + rng.integers(3, 256, int(n)).tolist() for n in (4, 9, 2, 14)]
    got = serve_with_arrivals(eng, prompts, SamplingParams(max_tokens=6, ignore_eos=True),
                              lambda e: len(e.scheduler.running) < 2 and e._stats["steps"] % 3 == 2)
    assert got == hf_greedy(hybrid_dir, prompts, 6)


@pytest.mark.parametrize("async_scheduling, spec, mixed", [
    (True, None, "padded"), (False, None, "padded"), (True, "mtp", "padded"), (True, "ngram", "padded"),
    (True, None, "exact"), (True, "mtp", "exact"), (True, None, "split"), (False, None, "split"),
    (True, "mtp", "split"), (True, "ngram", "split")])
def test_decode_rows_beside_a_prefill_row_replay_one_mixed_graph_or_split(hybrid_dir, async_scheduling, spec, mixed):
    """Requests that arrive while others decode: their prefill chunks share steps with the
    decode (or verify) rows. Such a step replays one mixed graph of both (``padded``: one decode
    row padded to the bucket of 2, whose pad row sits between the real one and the prefill row;
    ``exact``: a bucket of 1), or, without mixed graphs (``split``), runs its prefill row through a
    padded prefill graph and its decode rows apart (``forward_split``). Greedy tokens equal
    transformers'; the mixed replays or the splits really happened, and no capture's warm-up
    touched a real state."""
    from hybrid_engine import SpeculativeConfig
    llm = small_engine(hybrid_dir, async_scheduling=async_scheduling,
                       speculative_config=None if spec is None else SpeculativeConfig(spec, 2))
    pg = install_reruns(llm, decode_buckets={"padded": None, "exact": (1,), "split": ()}[mixed])
    eng = llm.engine
    serve_four_arrivals(eng, hybrid_dir)
    splits, mixed_keys = eng.runner.executor.splits, [k for k in pg.graphs if k.decode_rows]
    if mixed == "split":
        assert splits >= 2 and not mixed_keys and pg.mixed_steps == 0, (splits, list(pg.graphs))
    else:
        assert splits == 0 and pg.mixed_steps >= 2, (splits, pg.mixed_steps)
        assert {k.decode_rows for k in mixed_keys} == {2 if mixed == "padded" else 1}, mixed_keys
        # rows verify up to K = 2 drafts (fewer where adaptive speculation narrowed the step)
        assert {k.decode_len for k in mixed_keys} <= {1, 2, 3} and max(k.decode_len for k in mixed_keys) == \
            (3 if spec else 1), mixed_keys
    assert pg.replays >= 4, pg.replays
    assert all(not bad for _, bad in pg.captured), pg.captured
    # padded keys: every graph restores one row, and saves come in powers of two
    assert all(k.restores == 1 and k.saves in (0, 2, 4) for k in pg.graphs), list(pg.graphs)


@pytest.mark.parametrize("spec, mixed", [(None, "padded"), ("mtp", "padded"), (None, "exact")])
def test_a_mixed_replay_returns_the_eager_forwards_hidden_states_and_logits(hybrid_dir, spec, mixed):
    """Every mixed step's replay against the eager forward of the same batch from the same caches:
    the hidden states of every token (what MTP and prompt logprobs read) and the logits, in the
    step's order (decode rows, then the prefill row: the pad decode rows between them dropped), and
    the caches both leave behind."""
    from hybrid_engine import SpeculativeConfig
    from hybrid_engine.step.graphs import EagerExecutor
    from prefill_graph_harness import _snapshot
    llm = small_engine(hybrid_dir, speculative_config=None if spec is None else SpeculativeConfig(spec, 2))
    pg = install_reruns(llm, decode_buckets={"padded": None, "exact": (1,)}[mixed])
    eng, caches = llm.engine, llm.engine.runner.executor.caches
    real, checked = pg.forward, []

    def restore(snap):
        ck = caches.checkpoints
        for dst, src in ((caches.mamba.conv_all, snap["conv"]), (caches.mamba.ssm_all, snap["ssm"]),
                         (ck.conv_all, snap["ck_conv"]), (ck.ssm_all, snap["ck_ssm"]),
                         *zip(caches.kv.k, snap["k"]), *zip(caches.kv.v, snap["v"]),
                         *((t, snap[f"pending{i}"]) for i, t in enumerate(caches.mamba.pending_all))):
            dst.copy_(src)

    def compare(fb):
        if not fb.mamba.num_decode_rows:
            return real(fb)
        before = _snapshot(caches)
        want_h, want_l = (t.clone() for t in EagerExecutor.forward(eng.runner.executor, fb))
        after = _snapshot(caches)
        restore(before)
        got = real(fb)
        if got is None:
            return None
        torch.testing.assert_close(got[0], want_h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1], want_l, rtol=1e-5, atol=1e-5)
        now = _snapshot(caches)
        live = [x for x in range(now["conv"].shape[1]) if x != NULL_SLOT]     # NULL_SLOT: scratch
        for name in ("conv", "ssm", *(f"pending{i}" for i in range(len(caches.mamba.pending_all)))):
            torch.testing.assert_close(now[name][:, live], after[name][:, live], rtol=1e-5, atol=1e-5)
        for name in ("ck_conv", "ck_ssm"):
            torch.testing.assert_close(now[name], after[name], rtol=1e-5, atol=1e-5)
        for a, b in zip(now["k"] + now["v"], after["k"] + after["v"]):
            torch.testing.assert_close(a[1:], b[1:], rtol=1e-5, atol=1e-5)        # block 0: the null block
        checked.append(fb.mamba.num_decode_rows)
        return got
    pg.forward = compare
    serve_four_arrivals(eng, hybrid_dir)
    assert len(checked) >= 2 and pg.mixed_steps >= 2, (checked, pg.mixed_steps)


def test_mixed_replays_compose_with_sampling_logprobs_prompt_logprobs_and_n(hybrid_dir):
    """Requests of several kinds arriving while others decode, through mixed graphs, against the
    same engine running every step eagerly: output logprobs, prompt logprobs, seeded sampling with
    top-k, and ``n`` = 2 sharing a prefill. Tokens are equal and logprobs close; mixed replays
    really ran (with and without a logits row)."""
    rng = np.random.default_rng(21)
    system = rng.integers(3, 256, 13).tolist()
    prompts = [system + rng.integers(3, 256, int(n)).tolist() for n in (5, 9, 3, 11, 7)]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, top_k=20, seed=7),
              SamplingParams(max_tokens=5, ignore_eos=True, temperature=1.0, n=2, seed=3),
              SamplingParams(max_tokens=6, ignore_eos=True)]

    def serve(graphs: bool):
        llm = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=24,
                  block_size=BS, num_kv_blocks=96, enable_prefix_caching=True, mamba_checkpoint_interval=2)
        pg = install_reruns(llm) if graphs else None
        eng, outs, waiting = llm.engine, {}, list(range(len(prompts)))
        while waiting or eng.has_work():
            if waiting and (not eng.has_work() or eng._stats["steps"] % 3 == 2):
                i = waiting.pop(0)
                eng.add_requests(eng.make_requests(prompts[i], params[i], request_id=f"r{i}"))
            for r in eng.step() if eng.has_work() else ():
                if r.finished:
                    outs[r.request_id] = eng.make_output(r)
                    eng.forget(r)
        return outs, pg

    want, _ = serve(False)
    got, pg = serve(True)
    assert sorted(got) == sorted(want) and len(got) == 6, sorted(got)         # n = 2: two outputs
    for rid in want:
        a, b = got[rid], want[rid]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, rid
        for x, y in ((a.outputs[0].logprobs, b.outputs[0].logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
            assert (x is None) == (y is None), rid
            for pos_x, pos_y in zip(x or (), y or ()):          # per position: {token: logprob} or None
                assert (pos_x is None) == (pos_y is None) and (pos_x or {}).keys() == (pos_y or {}).keys(), rid
                for tok in pos_x or {}:
                    assert abs(pos_x[tok] - pos_y[tok]) <= 1e-4, (rid, tok, pos_x[tok], pos_y[tok])
            assert len(x or ()) == len(y or ()), rid
    assert pg.mixed_steps >= 2 and {k.logits for k in pg.graphs if k.decode_rows} == {0, 1}, list(pg.graphs)


def test_a_mixed_step_loads_its_decode_rows_first_then_pad_rows_then_the_prefill_row():
    """Two verify rows of 3 tokens and a prefill row of 5 tokens in a mixed graph of 4 decode
    rows: the real rows keep their places, the two pad rows are a decode graph's (token 0, the
    null block, NULL_SLOT, accepted 1, seq_len 3), and the prefill row starts after them, with its
    logits index moved by the 6 pad tokens. Loading a step of one decode row after it leaves no
    trace of the earlier one in the rows that became padding."""
    from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch, MambaMetadata
    from hybrid_engine.step.prefill_layout import load_prefill, mixed_decode_buckets, static_prefill_batch
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)   # noqa: E731

    def step(nd):
        td, n = 3 * nd, 5
        attn = AttnMetadata(torch.tensor([3 * i for i in range(nd + 1)] + [td + n], dtype=torch.int32),
                            torch.tensor([9, 12][:nd] + [25], dtype=torch.int32),
                            (torch.arange(12, dtype=torch.int32).view(3, 4) + 1)[2 - nd:],
                            i64(list(range(50, 50 + td + n))), n, 25)
        mamba = MambaMetadata(nd, 3, i64([4, 6][:nd]), i64([1, 2][:nd]), i64([0, n]), (0, n), i64([8]),
                              torch.tensor([True]), restore_slots=i64([8]), restore_rows=i64([3]),
                              ckpt_seq=i64([0]), ckpt_token=i64([2]), ckpt_rows=i64([7]))
        return ForwardBatch(i64(list(range(100, 100 + td + n))), i64(list(range(200, 200 + td + n))), attn, mamba,
                            i64(list(range(td)) + [td + n - 1]))

    assert mixed_decode_buckets((1, 2, 4, 8, 16, 32)) == (4, 16, 32) and mixed_decode_buckets((1, 2)) == (2,)
    assert mixed_decode_buckets(()) == ()
    two = step(2)
    assert PrefillKey.of(two, 2048) is None                     # no mixed graphs: the step splits
    key = PrefillKey.of(two, 2048, decode_buckets=(4, 16))
    assert key == PrefillKey(bucket=16, restores=1, saves=2, logits=1, decode_rows=4, decode_len=3)
    assert PrefillKey.of(step(2), 2048, decode_buckets=(1,)) is None   # more decode rows than any graph
    dst = static_prefill_batch(key, max_blocks=6, max_model_len=64, device=torch.device("cpu"))
    load_prefill(dst, two)
    a, m = dst.attn, dst.mamba
    assert dst.input_ids.tolist() == list(range(100, 106)) + [0] * 6 + list(range(106, 111)) + [0] * 11
    assert dst.positions[:6].tolist() == list(range(200, 206)) and dst.positions[12:17].tolist() == list(range(206, 211))
    assert a.query_start_loc.tolist() == [0, 3, 6, 9, 12, 17] and a.seq_lens.tolist() == [9, 12, 3, 3, 25]
    assert a.block_tables.tolist() == [[1, 2, 3, 4, 0, 0], [5, 6, 7, 8, 0, 0], [0] * 6, [0] * 6, [9, 10, 11, 12, 0, 0]]
    assert a.slot_mapping.tolist() == list(range(50, 56)) + [0] * 6 + list(range(56, 61)) + [0] * 11
    assert m.decode_slots.tolist() == [4, 6, NULL_SLOT, NULL_SLOT] and m.num_accepted.tolist() == [1, 2, 1, 1]
    assert m.prefill_slots.tolist() == [8, NULL_SLOT] and m.prefill_query_start_loc.tolist() == [0, 5, 16]
    assert m.restore_rows.tolist() == [3] and m.ckpt_token.tolist() == [2, 2]
    assert dst.logits_indices.tolist() == list(range(12)) + [16]
    one = step(1)
    assert PrefillKey.of(one, 2048, decode_buckets=(4, 16)) == key
    load_prefill(dst, one)
    assert dst.input_ids[:12].tolist() == [100, 101, 102] + [0] * 9
    assert a.seq_lens.tolist() == [9, 3, 3, 3, 25] and a.block_tables[1:4].sum() == 0
    assert a.block_tables[0].tolist() == [5, 6, 7, 8, 0, 0] and a.block_tables[4].tolist() == [9, 10, 11, 12, 0, 0]
    assert a.slot_mapping[3:12].tolist() == [0] * 9 and a.slot_mapping[12:17].tolist() == list(range(53, 58))
    assert m.decode_slots.tolist() == [4] + [NULL_SLOT] * 3 and m.num_accepted.tolist() == [1, 1, 1, 1]
    assert dst.logits_indices[12:].tolist() == [16]
    load_prefill(dst, one, harmless=True)
    assert m.decode_slots.tolist() == [NULL_SLOT] * 4 and not a.slot_mapping.any()
