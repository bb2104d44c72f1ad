"""The start-up warm-up (``hybrid_engine/warmup.py``): it runs its waves to completion on the
engine, leaves nothing behind (no request, block, slot or row held; counters at zero), and the
engine then serves exactly as one that never warmed up (greedy tokens equal, with and without
speculation; sampled tokens of requests without their own seed equal too: the engine's seed stream
is untouched); requests the engine's limits refuse are skipped, not fatal."""
import numpy as np
import pytest

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.step.prefill_layout import PrefillKey
from hybrid_engine.warmup import WARMUP_TOKENS, warm_up, warmup_lengths


def test_lengths_cover_chunk_budgets_and_fit_the_model():
    assert warmup_lengths(64, 4096) == [1, 2, 15, 16, 17, 31, 63, 64, 65, 100, 133, 255, 256, 257]
    lengths = warmup_lengths(2048, 300)
    assert max(lengths) <= 300 - WARMUP_TOKENS - 1 and 2048 not in lengths and 1 in lengths


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 2)])
def test_warm_up_leaves_the_engine_as_new(hybrid_dir, spec):
    kw = dict(max_num_seqs=4, max_num_batched_tokens=64, speculative_config=spec)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11], list(range(3, 40))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(hybrid_dir, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(hybrid_dir, **kw)
    eng = llm.engine
    free = eng.occupancy()
    report = warm_up(eng)
    lengths = warmup_lengths(64, eng.max_model_len)
    assert report.requests == len(lengths) + len(lengths[::4]) + 2
    assert report.steps > 0 and not eng.has_work() and eng.requests() == []
    assert eng.occupancy() == free, "the warm-up left blocks, slots or rows held"
    s = eng.stats()
    assert s["steps"] == s["prompt_tokens"] == s["generated_tokens"] == s["requests_finished"] == 0
    assert s["drafts_proposed"] == 0
    costs = getattr(eng.runner.policy, "costs", None)       # adaptive: warm-up's step times forgotten
    assert costs is None or (costs.samples == {} and costs.recent == {})
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.stats()["requests_finished"] == len(prompts)


def test_warm_up_refuses_a_busy_engine(hybrid_dir):
    llm = LLM(hybrid_dir, max_num_seqs=2)
    eng = llm.engine
    eng.add_requests(eng.make_requests([3, 4, 5], SamplingParams(max_tokens=2)))
    with pytest.raises(RuntimeError, match="idle engine"):
        warm_up(eng)


def test_sampled_outputs_after_a_warm_up_equal_those_without(hybrid_dir):
    """Requests with no seed of their own draw one from the engine's seed stream: the warm-up must
    not advance it."""
    params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    kw = dict(seed=3, max_num_batched_tokens=64)        # small chunks: the warm-up's prompts stay short
    want = [o.outputs[0].token_ids for o in LLM(hybrid_dir, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(hybrid_dir, **kw)
    warm_up(llm.engine)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want


def test_warm_up_skips_what_the_engine_refuses(hybrid_dir):
    """max_num_seqs 1 cannot run n = 2 samples together: that request is skipped, the rest run."""
    llm = LLM(hybrid_dir, max_num_seqs=1, max_num_batched_tokens=64)
    report = warm_up(llm.engine)
    lengths = warmup_lengths(llm.engine.cfg.scheduler.max_num_batched_tokens, llm.engine.max_model_len)
    assert report.requests == len(lengths) + len(lengths[::4]) + 1
    assert not llm.engine.has_work() and llm.engine.stats()["steps"] == 0


def test_split_lengths_hit_each_prefill_graph_bucket_once():
    from hybrid_engine.step.prefill_layout import prefill_bucket
    from hybrid_engine.warmup import mixed_warmup_lengths
    lengths = mixed_warmup_lengths(512, 8192)
    assert lengths == list(range(15, 512, 16))
    assert [prefill_bucket(n) for n in lengths] == list(range(16, 513, 16))
    assert mixed_warmup_lengths(512, 64) == [15, 31, 47, 63]
    assert mixed_warmup_lengths(1024, 8192)[-3:] == [959, 991, 1023]       # buckets of 32 past 512


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("mtp", 2)])
def test_warm_up_captures_the_mixed_steps_graphs(hybrid_dir, spec, monkeypatch):
    """With prefill graphs (the CPU stand-in), wave 4 runs one mixed step per bucket that fits the
    chunk budget beside the decoding row: during the wave every step replays a mixed graph, and
    each bucket's key (the decode row padded to 4, restore padded, one logits row: the keys of a
    chat turn beside a few decoding conversations) is replayed there; no capture touched a real
    state, and the engine then serves transformers' tokens with nothing held."""
    import hybrid_engine.warmup as warmup
    from hf_reference import hf_greedy
    from prefill_graph_harness import install_reruns
    llm = LLM(hybrid_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, block_size=4,
              num_kv_blocks=256, enable_prefix_caching=True, mamba_checkpoint_interval=2, speculative_config=spec)
    eng = llm.engine
    pg = install_reruns(llm)
    assert eng.prefill_graphs is pg
    if spec is not None:     # every draft accepted (a trained drafter): warm-up must still put rows at rest
        policy, real_observe = eng.runner.policy, eng.runner.policy.observe

        def accepting(token, num_valid):
            real_observe(token, np.where(num_valid > 0, token[2] + 1, num_valid))
        monkeypatch.setattr(policy, "observe", accepting)
    seen = []                                    # (key, replayed) of every prefill-graph call in wave 4
    real_wave, real_forward = warmup._mixed_wave, pg.forward

    def logged_forward(fb):
        got = real_forward(fb)
        seen.append((PrefillKey.of(fb, pg.max_tokens, pad_restores=True, decode_buckets=pg.decode_buckets),
                     got is not None))
        return got

    def wave(*a, **kw):
        mixed0 = pg.mixed_steps
        monkeypatch.setattr(pg, "forward", logged_forward)
        seen.append(("wave", kw.get("resting", False)))
        out = real_wave(*a, **kw)
        monkeypatch.setattr(pg, "forward", real_forward)
        wave_mixed.append(pg.mixed_steps - mixed0)
        return out
    wave_mixed = []
    monkeypatch.setattr(warmup, "_mixed_wave", wave)
    free = eng.occupancy()
    warm_up(eng)
    lengths = warmup.mixed_warmup_lengths(512, 128 - 1 - eng.num_spec)
    assert lengths == ([15, 31, 47, 63, 79, 95, 111, 127] if spec is None else [15, 31, 47, 63, 79, 95, 111])
    # with MTP (adaptive) one more wave beside a request at rest
    assert wave_mixed == [len(lengths)] * (1 if spec is None else 2) and eng.runner.executor.splits == 0, wave_mixed
    waves = [i for i, (k, _) in enumerate(seen) if k == "wave"]
    widths = [{k.decode_len for k, ok in seen[i + 1:j] if ok and k is not None and k.decode_rows}
              for i, j in zip(waves, waves[1:] + [len(seen)])]
    if spec is not None:
        # a new prompt each step: every step verifies both drafts (a fresh request's wish); prompts
        # every other step beside an anchor at rest (its drafts all rejected): no drafts
        assert widths[0] == {3} and widths[1] == {1}, widths
    seen = [x for x in seen if x[0] != "wave"]
    replayed = {(k.bucket, k.decode_rows, k.restores, k.logits) for k, ok in seen if ok and k is not None}
    assert {(n + 1, 4, 1, 1) for n in lengths} <= replayed, sorted(replayed)
    if spec is not None:
        for width in (1, 3):
            got = {k.bucket for k, ok in seen if ok and k is not None and k.decode_len == width and k.logits == 1}
            assert {n + 1 for n in lengths} <= got, (width, sorted(got))
    assert all(k.saves in (0, 2, 4, 8, 16, 32) for k in pg.graphs), list(pg.graphs)
    # wave 5: each bucket's prefill-only key (a request alone at an idle engine)
    alone = {k.bucket for k in pg.graphs if not k.decode_rows and k.logits == 1}
    assert {n + 1 for n in warmup.mixed_warmup_lengths(512, 128)} <= alone, sorted(alone)
    assert all(not bad for _, bad in pg.captured)
    assert not eng.has_work() and eng.requests() == [] and eng.occupancy() == free
    prompts = [list(range(3, 40)), [9, 10, 11] * 7]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(hybrid_dir, prompts, 6)


def test_the_mixed_wave_runs_once_per_small_decode_row_count(hybrid_dir):
    """With mixed graphs of 4 and 8 decode rows (max_num_seqs 8), wave 4 runs beside 1 and then 5
    decoding requests: every bucket's chat-turn key is replayed with 4 and with 8 decode rows, and
    the engine is left idle with nothing held."""
    from prefill_graph_harness import install_reruns
    from hybrid_engine.warmup import mixed_wave_anchors
    assert mixed_wave_anchors((4, 16, 32)) == [1, 5] and mixed_wave_anchors((4,)) == [1]
    assert mixed_wave_anchors((2,)) == [1] and mixed_wave_anchors(()) == []
    llm = LLM(hybrid_dir, dtype="float32", max_num_seqs=8, max_num_batched_tokens=128, block_size=4,
              num_kv_blocks=512, enable_prefix_caching=True, mamba_checkpoint_interval=2)
    eng = llm.engine
    pg = install_reruns(llm)
    assert pg.decode_buckets == (4, 8)
    free = eng.occupancy()
    warm_up(eng)
    import hybrid_engine.warmup as warmup
    keys = {(k.bucket, k.decode_rows) for k in pg.graphs if k.restores == 1 and k.logits == 1}
    for anchors, rows in ((1, 4), (5, 8)):
        lengths = warmup.mixed_warmup_lengths(512, 128 - anchors)
        assert {(n + 1, rows) for n in lengths} <= keys, (rows, sorted(keys))
    assert eng.runner.executor.splits == 0 and not eng.has_work() and eng.occupancy() == free


def test_warm_up_without_prefill_graphs_skips_the_mixed_wave(hybrid_dir):
    llm = LLM(hybrid_dir, max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.engine.prefill_graphs is None
    report = warm_up(llm.engine)
    lengths = warmup_lengths(64, llm.engine.max_model_len)
    assert report.requests == len(lengths) + len(lengths[::4]) + 2


def test_the_mixed_wave_skips_prompts_a_tiny_cache_refuses(hybrid_dir):
    """Wave 4's longer prompts do not fit a 12-block cache: they are skipped (as the other waves
    skip what the engine refuses), and start-up goes on."""
    from prefill_graph_harness import install_reruns
    llm = LLM(hybrid_dir, dtype="float32", max_num_seqs=4, block_size=16, num_kv_blocks=12, max_model_len=1024,
              enable_prefix_caching=True)
    install_reruns(llm)
    report = warm_up(llm.engine)
    assert report.requests > 0 and not llm.engine.has_work() and llm.engine.requests() == []
