"""The Mamba state pool's size is known before it is allocated (``MambaPool.bytes_for``), so an
engine whose slots cannot fit gets a ValueError naming the settings instead of an out-of-memory
error from inside its construction (seen on the 8B shape: 256 slots with 1 + K = 4 checkpoints need
~97 GiB; a spec engine's deferred pool, one state and the pending inputs, ~27 GiB)."""
import pytest
import torch

from hybrid_engine.mamba_cache.pool import MambaPool, check_pool_fits


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("layers,seqs,conv_dim,kernel,heads,hd,state,k,dtype", [
    (2, 3, 48, 4, 4, 8, 16, 0, torch.float32),
    (3, 5, 40, 4, 2, 16, 8, 3, torch.bfloat16),
    (1, 1, 24, 2, 3, 40, 128, 7, torch.float16),       # 3 head_dim blocks: 3 copies of dt and B
])
def test_bytes_for_equals_what_the_pool_allocates(layers, seqs, conv_dim, kernel, heads, hd, state, k, dtype,
                                                  deferred):
    args = (layers, seqs, conv_dim, kernel, heads, hd, state, k)
    pool = MambaPool(*args, dtype, torch.device("cpu"), deferred=deferred)
    assert MambaPool.bytes_for(*args, dtype, deferred=deferred) == pool.bytes
    assert pool.deferred == (deferred and k > 0)        # K = 0 verifies nothing: no pending inputs
    assert pool.ssm_all.shape[2] == (1 if pool.deferred else 1 + k)


def test_a_pool_too_large_is_a_value_error_naming_the_settings():
    # the 8B shape: 24 Mamba layers, conv 8192 + 2 x 8 x 128, 128 heads x 64 x 128 state
    need = MambaPool.bytes_for(24, 256, 10240, 4, 128, 64, 128, 3, torch.bfloat16)
    assert 95 * 2**30 < need < 100 * 2**30
    deferred = MambaPool.bytes_for(24, 256, 10240, 4, 128, 64, 128, 3, torch.bfloat16, deferred=True)
    assert 26 * 2**30 < deferred < 28 * 2**30
    check_pool_fits(need, need, max_num_seqs=256, num_spec=3)           # exactly fits: fine
    with pytest.raises(ValueError, match=r"max_num_seqs=256 request slots, num_speculative_tokens=3"):
        check_pool_fits(need, 30 * 2**30, max_num_seqs=256, num_spec=3)


def test_engine_build_checks_the_pool_against_free_memory_left_after_the_kv_cache(hybrid_dir, monkeypatch):
    """device_side's check on CUDA: free memory (plus what the allocator holds unused) minus the KV
    cache about to be allocated must hold the pool."""
    import dataclasses

    from hybrid_engine.config import EngineConfig
    from hybrid_engine.device_side import _check_mamba_pool_fits, _pool_args
    cfg = EngineConfig.resolve(hybrid_dir, max_num_seqs=4, enable_prefix_caching=False)
    cfg = dataclasses.replace(cfg, device=torch.device("cuda", 0))
    need = MambaPool.bytes_for(*_pool_args(cfg, 2), cfg.dtype, deferred=True)    # K = 2: a deferred pool
    kv_per_block = 4096
    free = {"now": 0}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["now"], 1 << 40))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 400)
    from hybrid_engine.attention import KVCache
    monkeypatch.setattr(KVCache, "bytes_per_block", staticmethod(lambda *a, **k: kv_per_block))
    free["now"] = need + 10 * kv_per_block - 600            # + 600 held unused by the allocator: exactly fits
    _check_mamba_pool_fits(cfg, 1, 10, 2)
    free["now"] -= 1
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        _check_mamba_pool_fits(cfg, 1, 10, 2)
    # prefix caching: the checkpoint pool (allocated after both) must fit what is left too
    ckpt = 5 * kv_per_block
    on = dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, enable_prefix_caching=True,
                                                            mamba_checkpoint_bytes=ckpt))
    free["now"] = need + 10 * kv_per_block + ckpt - 600
    _check_mamba_pool_fits(on, 1, 10, 2)
    free["now"] -= 1
    with pytest.raises(ValueError, match="checkpoint pool.*enable_prefix_caching=False"):
        _check_mamba_pool_fits(on, 1, 10, 2)
