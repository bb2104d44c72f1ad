"""Tensor parallelism on CPU (gloo): a model split over two processes gives the greedy tokens of
transformers (and of one process), with speculation and async scheduling; a killed worker ends the
engine with a clear error; bad sizes are refused before any process starts.

Each LLM(tensor_parallel_size=2) starts one worker process (a fresh interpreter: ~4 s here)."""
import os
import signal
import time

import numpy as np
import pytest
import torch

from hf_reference import fp8_kv_hooks, hf_greedy
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.config import SpeculativeConfig
from hybrid_engine.parallel import EngineDeadError
from hybrid_engine.parallel.sharding import Shard, shard_model_config
from hybrid_engine.config import ModelConfig

NEW = 10


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 250, n).tolist() for n in (1, 23, 6, 40, 3)]


def _tokens(llm, prompts, n=NEW):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_tp2_dense_and_moe_equal_transformers(model_dirs, prompts):
    """Mamba, attention, MLP and MoE blocks; an odd vocabulary (padded rows on rank 1); chunked
    prefill (a 16-token budget splits the long prompts); async scheduling; 4-token blocks, so rows
    grow their block lists during steady decode (whose step messages carry only the grown lists)."""
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)
    want = hf_greedy(d, prompts, NEW)
    with LLM(str(d), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16,
             max_num_seqs=4, block_size=4) as llm:
        assert _tokens(llm, prompts) == want
        assert llm.engine.runner.local.model.lm_head.weight.shape[0] == 126      # ceil(251 / 2) rows
        assert llm.engine.tp.group.channel is not None                           # messages via shared memory


def test_tp2_replicated_kv_head_tied_embeddings(model_dirs, prompts, monkeypatch):
    """One KV head (replicated on both ranks); a config that ties the embeddings with an lm_head
    stored beside them (the loader compares the two on each rank's rows). Step messages over gloo
    (the fallback when there is no shared-memory channel)."""
    monkeypatch.setenv("HYBRID_ENGINE_TP_CHANNEL", "gloo")
    d = model_dirs("tp_kv1", pattern="M*M-*", num_key_value_heads=1, tie_word_embeddings=True, seed=4)
    want = hf_greedy(d, prompts[:3], NEW)
    with LLM(str(d), device="cpu", tensor_parallel_size=2, async_scheduling=False) as llm:
        assert llm.engine.caches.kv.k[0].shape[-2] == 1
        assert llm.engine.tp.group.channel is None
        assert _tokens(llm, prompts[:3]) == want


@pytest.mark.parametrize("method,k", [("mtp", 2), ("ngram", 3)])
def test_tp2_speculation_equals_greedy(model_dirs, prompts, method, k):
    """MTP (the MTP block split like the backbone) and n-gram drafts verified under TP=2, async:
    the greedy tokens of transformers, and speculation really ran (drafts were accepted)."""
    d = model_dirs("spec_target", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)
    rep = [p + p[:5] for p in prompts]                          # repeats give the n-gram drafts hits
    want = hf_greedy(d, rep, NEW)
    with LLM(str(d), device="cpu", tensor_parallel_size=2,
             speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=k)) as llm:
        assert _tokens(llm, rep) == want
        stats = llm.engine.stats(expert_load=False)
        assert stats["drafts_proposed"] > 0


def test_tp2_async_llm_streams(model_dirs, prompts):
    """AsyncLLM (the server's engine) over TP=2: concurrent streams give transformers' tokens; its
    shutdown stops the worker."""
    import asyncio
    from hybrid_engine import AsyncLLM
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)
    want = hf_greedy(d, prompts[:3], NEW)
    eng = AsyncLLM(str(d), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16)

    async def one(i, p):
        tokens = []                                   # each streamed output carries the new tokens
        async for out in eng.generate(p, SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True),
                                      request_id=f"r{i}"):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        try:
            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts[:3])])
        finally:
            eng.shutdown()
    assert asyncio.run(main()) == want
    worker = eng.engine.tp.procs[0]
    assert worker.wait(timeout=30) == 0


def test_killed_worker_ends_the_engine(model_dirs, prompts):
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)
    llm = LLM(str(d), device="cpu", tensor_parallel_size=2)
    try:
        assert len(_tokens(llm, prompts[:2], 3)[0]) == 3
        worker = llm.engine.tp.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            _tokens(llm, prompts, 50)
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineDeadError):                        # and stays dead, at once
            _tokens(llm, prompts[:1], 2)
    finally:
        llm.shutdown()


def test_bad_sizes_are_refused_before_any_worker_starts(model_dirs):
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)   # 8 Mamba heads, 2 groups, 4 q heads
    with pytest.raises(ValueError, match="mamba_num_heads"):
        LLM(str(d), device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(d), device="cpu", tensor_parallel_size=0)
    mc = ModelConfig.from_json(d)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        shard_model_config(mc.__class__(**{**mc.__dict__, "num_key_value_heads": 3, "num_attention_heads": 6}), 2)
    # 3 groups over 2 ranks: neither whole groups per rank nor whole ranks per group
    with pytest.raises(ValueError, match="n_groups"):
        shard_model_config(mc.__class__(**{**mc.__dict__, "n_groups": 3, "mamba_num_heads": 6}), 2)


def test_tp2_one_group_split_over_ranks(model_dirs, prompts):
    """Fewer B / C groups than ranks (one group, two ranks): each rank holds the group's B / C and
    half its heads, and the gated norm sums its squares over both ranks (SplitGroupGatedNorm):
    the greedy tokens of transformers through prefill chunks and decode (where the decode SSU
    kernel leaves the norm to it), with MTP drafts verified."""
    from hybrid_engine.parallel.sharding import SplitGroupGatedNorm
    d = model_dirs("tp_one_group", pattern="M*-M-ME*", n_groups=1, seed=9, num_nextn_predict_layers=1)
    want = hf_greedy(d, prompts, NEW)
    with LLM(str(d), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=4,
             speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=2)) as llm:
        model = llm.engine.runner.local.model
        norms = [m.norm for m in model.modules() if type(m).__name__ == "Mamba2Mixer"]
        assert norms and all(isinstance(n, SplitGroupGatedNorm) for n in norms)
        assert model.backbone.layers[0].mixer.G == 1 and model.backbone.layers[0].mixer.H == 4
        assert _tokens(llm, prompts) == want
        assert llm.engine.stats(expert_load=False)["drafts_proposed"] > 0


def test_tp4_two_groups_over_four_ranks(model_dirs, prompts):
    """Two groups over four ranks (ranks 0-1 hold group 0's B / C, ranks 2-3 group 1's): greedy
    tokens of transformers."""
    d = model_dirs("tp_two_groups", pattern="M*-M", n_groups=2, seed=10)
    want = hf_greedy(d, prompts[:3], NEW)
    with LLM(str(d), device="cpu", tensor_parallel_size=4, max_num_seqs=4) as llm:
        assert llm.engine.runner.local.model.backbone.layers[0].mixer.G == 1
        assert _tokens(llm, prompts[:3]) == want


def test_split_group_gated_norm_equals_the_unsplit_norm():
    """Each rank's output of SplitGroupGatedNorm is its channels of the unsplit gated norm: 2 groups
    over 4 ranks (ranks 0-1 share group 0, 2-3 group 1), the all-reduce played by summing the
    ranks' tables."""
    from hybrid_engine.mamba_cache.ops.gated_norm import gated_rmsnorm_ref
    from hybrid_engine.parallel.sharding import SplitGroupGatedNorm
    g = torch.Generator().manual_seed(0)
    T, I, G, N = 5, 32, 2, 4
    y, z, w = (torch.randn(T, I, generator=g) for _ in range(3))
    w = w[0]
    want = gated_rmsnorm_ref(y, z, w, I // G, 1e-5)
    part = I // N
    tables = []

    def collect(t):
        tables.append(t.clone())
        return t
    norms = []
    for r in range(N):
        n = SplitGroupGatedNorm(part, group=r // (N // G), groups=G, group_channels=I // G, all_reduce=collect)
        n.weight.data.copy_(w[r * part:(r + 1) * part])
        norms.append(n)
        n(y[:, r * part:(r + 1) * part], z[:, r * part:(r + 1) * part], part, 1e-5, "gate_then_norm")
    total = torch.stack(tables).sum(0)                             # what the all-reduce gives every rank
    for r, n in enumerate(norms):
        n._all_reduce = lambda t: total
        got = n(y[:, r * part:(r + 1) * part], z[:, r * part:(r + 1) * part], part, 1e-5, "gate_then_norm")
        torch.testing.assert_close(got, want[:, r * part:(r + 1) * part], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="gate_then_norm"):
        norms[0](y[:, :part], z[:, :part], part, 1e-5, "norm_then_gate")


def test_shard_take_sections_and_padding():
    full = torch.arange(20.0).view(10, 2)
    s = Shard(dim=0, sections=((1, 2), (6, 3)), full=10)
    assert s.full_shape((5, 2)) == (10, 2)
    assert s.take(full).tolist() == [[2, 3], [4, 5], [12, 13], [14, 15], [16, 17]]
    pad = Shard(dim=0, sections=((8, 4),), full=10)          # the last rank of a padded vocabulary
    assert pad.take(full).tolist() == [[16, 17], [18, 19], [0, 0], [0, 0]]
    cols = Shard(dim=2, sections=((1, 1),), full=2)           # one expert of a merged [E, D, F]: offset 1
    assert cols.take(full.view(5, 2, 2)[0], offset=1).tolist() == [[1], [3]]
    assert Shard(zero=True).take(full).abs().sum() == 0


def test_shard_model_config_sizes(model_dirs):
    mc = ModelConfig.from_json(model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3))
    part = shard_model_config(mc, 2)
    assert (part.mamba_num_heads, part.n_groups, part.num_attention_heads, part.num_key_value_heads) == \
        (mc.mamba_num_heads // 2, mc.n_groups // 2, mc.num_attention_heads // 2, mc.num_key_value_heads // 2)
    assert part.conv_dim == mc.conv_dim // 2 and part.vocab_size == mc.vocab_size
    assert part.moe_intermediate_size == mc.moe_intermediate_size // 2


def test_tp2_draft_model_and_prefix_caching(model_dirs, prompts):
    """A replicated draft model, and prefix caching (the scheduler's hits, every rank's Mamba
    checkpoints restored and saved), both under TP=2: the tokens of transformers, with real hits."""
    d = model_dirs("spec_target", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)
    draft = model_dirs("tp_draft", pattern="M*", hidden_size=32, seed=9)
    shared = prompts[3][:33]
    batch = [shared + p for p in prompts[:2]]
    want = hf_greedy(d, batch, 6)
    with LLM(str(d), device="cpu", tensor_parallel_size=2, block_size=4, enable_prefix_caching=True,
             mamba_checkpoint_interval=2, num_kv_blocks=256, mamba_checkpoint_bytes=16 << 20,
             speculative_config=SpeculativeConfig(method="draft_model", num_speculative_tokens=2,
                                                  model=str(draft))) as llm:
        first = _tokens(llm, batch[:1], 6)
        rest = llm.generate(batch[1:], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        assert first + [list(o.outputs[0].token_ids) for o in rest] == want
        assert all(o.num_cached_tokens > 0 for o in rest)


def test_killed_worker_fails_async_streams(model_dirs, prompts):
    """AsyncLLM: a dead worker ends the step loop; the streams end with an error naming it."""
    import asyncio
    from hybrid_engine import AsyncLLM
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)
    eng = AsyncLLM(str(d), device="cpu", tensor_parallel_size=2)

    async def stream(p):
        last = None
        async for last in eng.generate(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)):
            pass
        return last

    async def main():
        first = await stream(prompts[0][:3])                     # the engine works
        os.kill(eng.engine.tp.procs[0].pid, signal.SIGKILL)
        t0 = time.monotonic()
        ends = await asyncio.gather(*[stream(p) for p in prompts[:2]])
        return first, ends, time.monotonic() - t0
    try:
        first, ends, took = asyncio.run(main())
    finally:
        eng.shutdown()
    assert first.error is None
    assert all(o.finished and o.outputs[0].finish_reason == "error" and "worker rank 1" in o.error for o in ends)
    assert took < 10


def test_tp2_fp8_quantized_at_load(model_dirs, prompts):
    """quantization="fp8" under TP=2: each rank quantizes its share after loading it. Rank 0's
    row-parallel out_proj dequantizes to its columns of the checkpoint's weight (to FP8 rounding),
    and the engine generates. (Tokens are not compared with TP=1's FP8: a row-parallel layer's
    per-channel scales cover the rank's columns only, so the quantized weights differ, and a
    near-tie flipped one token of 16 here.)"""
    from safetensors import safe_open
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)
    with LLM(str(d), device="cpu", quantization="fp8", tensor_parallel_size=2) as llm:
        proj = llm.engine.runner.local.model.backbone.layers[0].mixer.out_proj
        assert type(proj).__name__ == "Fp8Linear"
        deq = proj.weight.float() * proj.weight_scale.float().reshape(-1, 1)
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            name = next(k for k in f.keys() if k.endswith("layers.0.mixer.out_proj.weight"))
            full = f.get_tensor(name).float()
        mine = full[:, :full.shape[1] // 2]                           # rank 0's columns
        assert deq.shape == mine.shape
        assert torch.allclose(deq, mine, rtol=0.07, atol=1e-3 * float(mine.abs().max()))
        assert all(len(t) == 8 for t in _tokens(llm, prompts[:2], 8))


def test_tp2_fp8_kv_cache(model_dirs, prompts):
    """kv_cache_dtype="fp8" under TP=2: each rank stores FP8 codes of its own KV heads (one of the
    two here) with the per-layer scales (1.0: no checkpoint scales) replicated; greedy tokens equal
    transformers with k_proj / v_proj passed through the FP8 round trip, under chunked prefill."""
    d = model_dirs("tp_moe", pattern="M*-EM*E", vocab_size=251, seed=3)
    with fp8_kv_hooks(d, [1.0, 1.0], [1.0, 1.0]):
        want = hf_greedy(d, prompts, NEW)
    with LLM(str(d), device="cpu", tensor_parallel_size=2, kv_cache_dtype="fp8", max_num_batched_tokens=16,
             max_num_seqs=4, block_size=4) as llm:
        kv = llm.engine.caches.kv
        assert kv.k[0].dtype == torch.float8_e4m3fn and kv.k[0].shape[-2] == 1 and float(kv.v_scale[1]) == 1.0
        assert _tokens(llm, prompts) == want
