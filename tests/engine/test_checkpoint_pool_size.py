"""The Mamba checkpoint pool's default size (hybrid_engine/device_side.py): an eighth of the KV
cache's bytes with the drafter's KV, 64 MiB to 4 GiB, at least ``max_num_seqs`` + 16 rows within a
quarter of the KV; on CUDA its share comes out of the KV budget first."""
import os

import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
BS = 4


def test_on_by_default_with_an_auto_sized_checkpoint_pool(hybrid_dir):
    """``LLM(...)`` caches prefixes unless told not to; the checkpoint pool's default budget is an
    eighth of the KV cache's bytes, at least 64 MiB, at most 4 GiB (and one row per KV block at
    most); an explicit budget or ``enable_prefix_caching=False`` overrides it."""
    from hybrid_engine.device_side import auto_checkpoint_bytes
    assert auto_checkpoint_bytes(1 << 20) == 64 << 20
    assert auto_checkpoint_bytes(8 << 30) == 1 << 30
    assert auto_checkpoint_bytes(64 << 30) == 4 << 30
    kw = dict(dtype="float32", device=DEV, max_num_seqs=2, block_size=BS)
    llm = LLM(hybrid_dir, **kw)
    eng = llm.engine
    st = eng.stats(expert_load=False)
    rows, nblocks = st["mamba_checkpoints_total"], eng.scheduler.blocks.num_total
    row_bytes = st["mamba_checkpoint_bytes"] // rows
    assert rows == min(auto_checkpoint_bytes(eng.caches.kv.bytes) // row_bytes, nblocks)   # num_total: no null block
    prompt = list(range(3, 3 + 4 * BS + 2))
    sp = SamplingParams(max_tokens=2, ignore_eos=True)
    first, again = (llm.generate([prompt], sp, use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 4 * BS
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    small = LLM(hybrid_dir, num_kv_blocks=64, mamba_checkpoint_bytes=3 * row_bytes, **kw).engine
    assert small.stats(expert_load=False)["mamba_checkpoints_total"] == 3
    off = LLM(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False, **kw)
    assert "mamba_checkpoints_total" not in off.engine.stats(expert_load=False)
    assert off.generate([prompt], sp, use_tqdm=False)[0].num_cached_tokens == 0


def test_the_auto_pool_counts_the_drafters_kv(hybrid_dir, monkeypatch):
    """The auto-sized pool is an eighth of the whole KV cache, the MTP block's attention KV
    included: ``checkpoint_reserve`` set that much aside on CUDA, and counting the target's KV
    alone gave an MTP engine 20% fewer rows on the 8B shape (28 where 36 were reserved). The 64 MiB
    floor is lifted so that the tiny model's eighth decides."""
    import hybrid_engine.device_side as device_side
    from hybrid_engine.device_side import auto_checkpoint_bytes
    from hybrid_engine.spec.drafters import drafter_footprint
    monkeypatch.setattr(device_side, "AUTO_CHECKPOINT_MIN_BYTES", 0)
    rows = {}
    for spec in (None, SpeculativeConfig("mtp", 2)):
        eng = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=2, block_size=BS, num_kv_blocks=4000,
                  speculative_config=spec).engine
        st = eng.stats(expert_load=False)
        rows[spec is None] = n = st["mamba_checkpoints_total"]
        mtp_kv = 4000 * drafter_footprint(eng.cfg).kv_bytes_per_block
        assert (mtp_kv > 0) == (spec is not None)
        assert n == auto_checkpoint_bytes(eng.caches.kv.bytes + mtp_kv) // (st["mamba_checkpoint_bytes"] // n)
    assert rows[False] > rows[True]                    # the MTP block's KV counts too


def test_auto_checkpoint_pool_comes_out_of_the_cuda_kv_budget(monkeypatch):
    """On CUDA the auto-sized pool's share (a ninth of the KV budget, 64 MiB - 4 GiB) is taken out
    of ``kv_cache_memory_fraction`` of free memory before the KV cache is sized, so caching on by
    default does not eat the memory left beside the budget; nothing is set aside when caching is
    off or the pool's size is given."""
    import types
    import hybrid_engine.device_side as device_side
    from hybrid_engine.config import CacheConfig
    from hybrid_engine.device_side import _kv_budget, checkpoint_reserve
    gib = 1 << 30
    # 6 GiB free: budgets under the 4 GiB per-engine cap tests/conftest.py puts on CUDA engines
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 * gib, 80 * gib))
    monkeypatch.setattr(device_side, "checkpoint_floor_bytes", lambda cfg: 0)     # the eighth decides here

    def budget(**kw):
        return _kv_budget(types.SimpleNamespace(device=torch.device("cuda"), cache=CacheConfig(**kw)))
    assert budget() == 3 * gib - 3 * gib // 9
    assert budget(kv_cache_memory_fraction=0.25) == 3 * gib // 2 - (3 * gib // 2) // 9
    assert budget(enable_prefix_caching=False) == 3 * gib
    assert budget(mamba_checkpoint_bytes=gib) == 3 * gib
    assert checkpoint_reserve(CacheConfig(), 90 * gib) == 4 * gib
    assert checkpoint_reserve(CacheConfig(), 100 << 20) == 50 << 20   # floor 64 MiB, at most half
    assert checkpoint_reserve(CacheConfig(num_kv_blocks=64), 36 * gib) == 0
    # a floor above the eighth is set aside, up to a fifth of the budget (a quarter of the KV left)
    assert checkpoint_reserve(CacheConfig(), 36 * gib, floor_bytes=5 * gib) == 5 * gib
    assert checkpoint_reserve(CacheConfig(), 9 * gib, floor_bytes=5 * gib) == 9 * gib // 5
    monkeypatch.setattr(device_side, "checkpoint_floor_bytes", lambda cfg: 2 * gib)
    assert budget() == 3 * gib - 3 * gib // 5
    assert budget(mamba_checkpoint_bytes=gib) == 3 * gib
    # what is reserved is what the pool built from the KV cache left takes
    for b, f in ((9 * gib, 5 * gib), (50 * gib, 21 * gib // 2), (36 * gib, 5 * gib), (36 * gib, 0), (3 * gib, gib)):
        r = checkpoint_reserve(CacheConfig(), b, floor_bytes=f)
        assert abs(device_side.auto_checkpoint_bytes(b - r, f) - r) <= 8, (b, f, r)


def test_the_auto_pool_keeps_a_row_per_running_request_and_spares(hybrid_dir, monkeypatch):
    """The auto pool holds at least ``max_num_seqs + CHECKPOINT_SPARE_ROWS`` rows where that is at
    most a quarter of the KV cache's bytes: fewer rows than conversations lose the checkpoints of
    the ones about to return (the 8B shape with MTP: 36 rows under 32 conversations, caching on
    slower than off). The 64 MiB minimum is lifted so that the tiny model's eighth is below the
    floor."""
    import hybrid_engine.device_side as device_side
    from hybrid_engine.device_side import CHECKPOINT_SPARE_ROWS, auto_checkpoint_bytes
    assert auto_checkpoint_bytes(8 << 30, floor_bytes=3 << 30) == 2 << 30     # a quarter at most
    assert auto_checkpoint_bytes(8 << 30, floor_bytes=3 << 29) == 3 << 29
    assert auto_checkpoint_bytes(64 << 30, floor_bytes=5 << 30) == 5 << 30    # past the 4 GiB cap
    assert auto_checkpoint_bytes(8 << 30, floor_bytes=1 << 20) == 1 << 30     # the eighth is more
    monkeypatch.setattr(device_side, "AUTO_CHECKPOINT_MIN_BYTES", 0)
    rows = {}
    for seqs in (2, 24):
        eng = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=seqs, block_size=BS, kv_cache_bytes=8 << 20,
                  max_num_batched_tokens=256).engine
        st = eng.stats(expert_load=False)
        rows[seqs] = n = st["mamba_checkpoints_total"]
        row_bytes = st["mamba_checkpoint_bytes"] // n
        eighth = eng.caches.kv.bytes // 8 // row_bytes
        assert n == max(eighth, min(seqs + CHECKPOINT_SPARE_ROWS, eng.caches.kv.bytes // 4 // row_bytes)), (n, eighth)
    assert rows[24] > rows[2] and rows[24] == 24 + CHECKPOINT_SPARE_ROWS, rows
    # num_kv_blocks sizes the KV cache by hand: no floor (nothing was reserved for it), an eighth
    fixed = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=24, block_size=BS, max_num_batched_tokens=256,
                num_kv_blocks=eng.scheduler.blocks.num_total + 1).engine
    st = fixed.stats(expert_load=False)
    assert st["mamba_checkpoints_total"] == fixed.caches.kv.bytes // 8 // (st["mamba_checkpoint_bytes"] //
                                                                          st["mamba_checkpoints_total"]) < rows[24]
