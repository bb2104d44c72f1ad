"""Prefill CUDA graphs (hybrid_engine/step/prefill_graphs.py): one-request prefill-only steps
replayed from lazily captured graphs give transformers' greedy tokens (float32, O(1) weights,
the Triton Mamba kernels: chunks that save checkpoints, turns that restore one), equal the eager
engine's state, and launch with no host sync once captured; steps of decode rows plus one
prefill row replay one mixed graph (or, without mixed graphs, a decode graph and a prefill graph). The padding and the warm-up are
tested on CPU in tests/engine/test_prefill_graphs.py."""
import numpy as np
import pytest
import torch

from engine_steps import launch_steps_without_sync
from hf_reference import hf_greedy
from prefill_graph_harness import serve_with_arrivals
from hybrid_engine import LLM, SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("gpu_prefill_graphs", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)


def one_turn_at_a_time(llm, rng, turns=6, first=45, user=(2, 30)):
    convo = rng.integers(3, 256, first).tolist()
    out = []
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for _ in range(turns):
        prompt = convo + rng.integers(3, 256, int(rng.integers(*user))).tolist()
        o = llm.generate([prompt], sp, use_tqdm=False)[0]
        out.append((prompt, o.outputs[0].token_ids, o.num_cached_tokens))
        convo = prompt + o.outputs[0].token_ids
    return out


def test_prefill_graphs_match_transformers_and_the_eager_engine(target):
    runs, states = {}, {}
    for graphs in (False, True):
        llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=4, max_num_batched_tokens=40, block_size=4,
                  num_kv_blocks=128, enable_prefix_caching=True, mamba_checkpoint_interval=2,
                  prefill_cuda_graphs=graphs)
        runs[graphs] = one_turn_at_a_time(llm, np.random.default_rng(0))
        pg = llm.engine.runner.executor.prefill
        if graphs:
            keys = list(pg.graphs)
            assert any(k.restores for k in keys) and any(k.saves for k in keys), keys
            assert {k.logits for k in keys} == {0, 1}, keys
            assert pg.staged_steps > 0, pg.staged_steps     # later steps of a key: staged into its arena
        else:
            assert pg is None
        ck = llm.engine.caches.checkpoints
        states[graphs] = (llm.engine.caches.mamba.ssm_all[:, 1:].clone(), ck.ssm_all.clone())
    for (p, a, c), (_, b, _) in zip(runs[True], runs[False]):
        assert a == b == hf_greedy(target, [p], 4)[0]
    assert sum(c > 0 for _, _, c in runs[True]) >= 4
    for a, b in zip(states[True], states[False]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_long_prefills_with_mtp_match_transformers(target):
    """Buckets of several SSD chunks (prompts of ~150-400 tokens, one chunk each) on an MTP engine:
    the drafter reads the replayed hidden states of every prefill token; greedy tokens equal
    transformers'."""
    from hybrid_engine import SpeculativeConfig
    llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=4, max_num_batched_tokens=512, block_size=4,
              num_kv_blocks=512, enable_prefix_caching=True, mamba_checkpoint_interval=8,
              speculative_config=SpeculativeConfig("mtp", 2))
    out = one_turn_at_a_time(llm, np.random.default_rng(2), turns=4, first=150, user=(20, 90))
    keys = list(llm.engine.runner.executor.prefill.graphs)
    assert max(k.bucket for k in keys) >= 144 and any(k.restores for k in keys), keys
    for p, toks, _ in out:
        assert toks == hf_greedy(target, [p], 4)[0]


@pytest.mark.parametrize("spec, mixed", [(None, True), ("mtp", True), (None, False), ("mtp", False)])
def test_decode_rows_beside_a_prefill_row_replay_a_mixed_graph_or_two(target, spec, mixed, monkeypatch):
    """Requests that arrive while others decode: a step of decode (verify) rows plus one prefill
    row replays one mixed graph (decode rows padded to the mixed count), or without mixed graphs a
    decode graph and a prefill graph (``forward_split``). float32, O(1) weights: greedy tokens
    equal transformers', and such steps really took that path."""
    import hybrid_engine.step.graphs as graphs_mod
    from hybrid_engine import SpeculativeConfig
    splits = []
    real = graphs_mod.forward_split

    def counted(fb, *a):
        got = real(fb, *a)
        splits.append((fb.mamba.num_decode_rows, got is not None))
        return got
    monkeypatch.setattr(graphs_mod, "forward_split", counted)
    llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=4, max_num_batched_tokens=40, block_size=4,
              num_kv_blocks=256, enable_prefix_caching=True, mamba_checkpoint_interval=2,
              speculative_config=None if spec is None else SpeculativeConfig(spec, 2))
    pg = llm.engine.runner.executor.prefill
    assert pg.decode_buckets == (4,)
    if not mixed:
        pg.decode_buckets = ()
    eng, rng = llm.engine, np.random.default_rng(4)
    system = rng.integers(3, 256, 30).tolist()
    prompts = [system + rng.integers(3, 256, int(n)).tolist() for n in (5, 17, 3, 26, 9)]
    got = serve_with_arrivals(eng, prompts, SamplingParams(max_tokens=8, ignore_eos=True),
                              lambda e: e._stats["steps"] % 4 == 3)
    assert got == hf_greedy(target, prompts, 8)
    if mixed:
        assert pg.mixed_steps >= 3 and not splits, (pg.mixed_steps, splits)
        assert any(k.decode_rows == 4 for k in pg.graphs), list(pg.graphs)
    else:
        assert sum(ok for _, ok in splits) >= 3 and pg.mixed_steps == 0, splits


def test_captured_prefill_steps_never_sync_the_host(target):
    """The first restoring step of a shape captures (a deliberate sync, out of the detector's
    sight); the next one of that shape replays under the sync detector, with the decode after, and
    so does a third one's step beside that decode (the split into two replays)."""
    llm = LLM(target, dtype="bfloat16", device="cuda", max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
              num_kv_blocks=256, enable_prefix_caching=True, mamba_checkpoint_interval=2)
    eng, rng, sp = llm.engine, np.random.default_rng(1), SamplingParams(max_tokens=2, ignore_eos=True)
    system = rng.integers(3, 256, 40).tolist()
    user = lambda: rng.integers(3, 256, 12).tolist()      # noqa: E731
    llm.generate([system + user()], sp, use_tqdm=False)  # publishes the prefix
    llm.generate([system + user()], sp, use_tqdm=False)  # captures the restoring step's graph
    n = len(eng.runner.executor.prefill.graphs)
    eng.add_request(eng.make_request(system + user(), SamplingParams(max_tokens=8, ignore_eos=True)))
    launch_steps_without_sync(eng, 5)                    # the restoring prefill (a replay), then decode
    assert len(eng.runner.executor.prefill.graphs) == n  # no new capture: the step above was a replay
    assert eng.runner.executor.prefill.staged_steps >= 1  # ... staged into its arena (pinned ring, one copy)
    # a request of the same shape arrives while that one decodes: its step is a mixed step (a new
    # key: captured here, then replayed by a third such request under the detector)
    long = SamplingParams(max_tokens=12, ignore_eos=True)
    for r in list(eng.scheduler.running):
        eng.abort(r.request_id)
    eng.add_request(eng.make_request(system + user(), long, "anchor"))
    launch_steps_without_sync(eng, 2)                    # a replay of the key above, then decode
    eng.add_request(eng.make_request(system + user(), SamplingParams(max_tokens=1, ignore_eos=True)))
    eng.step()                                           # the mixed key's capture (a deliberate sync)
    eng.step()
    n = len(eng.runner.executor.prefill.graphs)
    eng.add_request(eng.make_request(system + user(), SamplingParams(max_tokens=2, ignore_eos=True)))
    launch_steps_without_sync(eng, 2)
    assert len(eng.runner.executor.prefill.graphs) == n and eng.runner.executor.prefill.mixed_steps >= 2
    assert eng.stats(expert_load=False)["prefix_cache_hits"] >= 3
    for r in list(eng.scheduler.running):
        eng.abort(r.request_id)
