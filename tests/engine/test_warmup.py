"""The start-up warm-up (``hybrid_engine/warmup.py``): it runs its waves to completion on the
engine, leaves nothing behind (no request, block, slot or row held; counters at zero), and the
engine then serves exactly as one that never warmed up (greedy tokens equal, with and without
speculation; sampled tokens of requests without their own seed equal too: the engine's seed stream
is untouched); requests the engine's limits refuse are skipped, not fatal."""
import pytest

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
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
    from hybrid_engine.step.prefill_graphs import prefill_bucket
    from hybrid_engine.warmup import split_warmup_lengths
    lengths = split_warmup_lengths(512, 8192)
    assert lengths == list(range(15, 512, 16))
    assert [prefill_bucket(n) for n in lengths] == list(range(16, 513, 16))
    assert split_warmup_lengths(512, 64) == [15, 31, 47, 63]
    assert split_warmup_lengths(1024, 8192)[-3:] == [959, 991, 1023]       # buckets of 32 past 512


def test_warm_up_captures_the_split_steps_prefill_graphs(hybrid_dir):
    """With prefill graphs (the CPU stand-in), wave 4 runs one split step per bucket that fits the
    chunk budget: each bucket's graph is captured during the warm-up (restore padded, one save,
    one logits row: the keys of a chat turn), no capture touched a real state, and the engine
    then serves transformers' tokens with nothing held."""
    from hf_reference import hf_greedy
    from prefill_graph_harness import install_reruns
    from hybrid_engine.warmup import split_warmup_lengths
    llm = LLM(hybrid_dir, dtype="float32", max_num_seqs=4, max_num_batched_tokens=128, block_size=4,
              num_kv_blocks=256, enable_prefix_caching=True, mamba_checkpoint_interval=2)
    eng = llm.engine
    pg = install_reruns(llm)
    assert eng.prefill_graphs is pg
    free = eng.occupancy()
    warm_up(eng)
    lengths = split_warmup_lengths(512, 128)
    assert lengths == [15, 31, 47, 63, 79, 95, 111, 127]
    split_keys = {(k.bucket, k.restores, k.logits) for k in pg.graphs}
    assert {(n + 1, 1, 1) for n in lengths} <= split_keys, sorted(split_keys)
    assert all(k.saves in (0, 2, 4, 8, 16, 32) for k in pg.graphs), list(pg.graphs)
    assert eng.runner.executor.splits >= len(lengths) and all(not bad for _, bad in pg.captured)
    assert not eng.has_work() and eng.requests() == [] and eng.occupancy() == free
    prompts = [list(range(3, 40)), [9, 10, 11] * 7]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(hybrid_dir, prompts, 6)


def test_warm_up_without_prefill_graphs_skips_the_split_wave(hybrid_dir):
    llm = LLM(hybrid_dir, max_num_seqs=4, max_num_batched_tokens=64)
    assert llm.engine.prefill_graphs is None
    report = warm_up(llm.engine)
    lengths = warmup_lengths(64, llm.engine.max_model_len)
    assert report.requests == len(lengths) + len(lengths[::4]) + 2
