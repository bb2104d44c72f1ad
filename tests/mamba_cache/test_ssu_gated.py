"""State update + gated norm (CONTRACT item 6) on CPU: the public op is the unfused composition bit
for bit, checks its arguments, and the Mamba2 mixer takes it on decode-only steps only."""
import math

import pytest
import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache import ops as mops
from hybrid_engine.mamba_cache.ops import (gated_rmsnorm, reserve_ssu_norm_counters, selective_state_update,
                             selective_state_update_gated)
from oracles import ssm_params


def _case(dtype, N=5, s=3, K=3, H=4, G=2, P=6, Nst=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    I = H * P
    x = torch.randn(N, s, H, P, generator=gen).to(dtype)
    dt = (torch.randn(N, s, H, generator=gen) * 0.5).to(dtype)
    B = torch.randn(N, s, G, Nst, generator=gen).to(dtype)
    C = torch.randn(N, s, G, Nst, generator=gen).to(dtype)
    dt_bias, A, D = ssm_params(H, G, Nst, P, gen)
    pool = torch.full((N + 2, 1 + K, H, P, Nst), math.nan)
    pool[1:N + 1] = torch.randn(N, 1 + K, H, P, Nst, generator=gen)
    pool[NULL_SLOT] = -7.0                 # finite: the reference reads it for null rows
    slots = torch.arange(1, N + 1, dtype=torch.int64)
    slots[1] = NULL_SLOT
    acc = torch.randint(1, K + 2, (N,), generator=gen)
    z = torch.randn(N * s, I + 5, generator=gen).to(dtype)[:, 2:2 + I]     # strided, as in models
    w = (1 + 0.1 * torch.randn(I, generator=gen)).to(dtype)
    return pool, (x, dt, dt_bias, A, B, C, D, slots, acc), z, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("groups", [1, 2, 8])            # 8: half a head per norm group
def test_gated_is_the_composition_bit_for_bit(dtype, groups):
    pool, args, z, w = _case(dtype, seed=groups)
    N, s, H, P = args[0].shape
    gs, lim = H * P // groups, (0.01, 0.5)
    p1, p2 = pool.clone(), pool.clone()
    out = selective_state_update_gated(p1, *args, z, w, gs, 1e-5, dt_limit=lim)
    y = selective_state_update(p2, *args, dt_limit=lim, out_dtype=dtype)
    exp = gated_rmsnorm(y.reshape(N * s, H * P), z, w, gs, 1e-5).view(N, s, H * P)
    assert out.dtype == dtype and out.shape == (N, s, H * P)
    assert torch.equal(out, exp)
    torch.testing.assert_close(p1, p2, rtol=0, atol=0, equal_nan=True)
    out3 = selective_state_update_gated(pool.clone(), *args, z.unflatten(0, (N, s)), w, gs, 1e-5,
                                        dt_limit=lim)                     # z as [N, s, I]
    assert torch.equal(out3, out)


def test_gated_bad_arguments():
    pool, args, z, w = _case(torch.float32)
    N, s, H, P = args[0].shape
    with pytest.raises(ValueError, match="group_size=5 must be a positive divisor of H\\*P=24"):
        selective_state_update_gated(pool, *args, z, w, 5, 1e-5)
    with pytest.raises(ValueError, match="group_size"):
        selective_state_update_gated(pool, *args, z, w, 0, 1e-5)
    with pytest.raises(ValueError, match="z has shape"):
        selective_state_update_gated(pool, *args, z[:-1], w, 12, 1e-5)
    with pytest.raises(ValueError, match="norm_weight has shape"):
        selective_state_update_gated(pool, *args, z, w[:-1], 12, 1e-5)
    reserve_ssu_norm_counters("cpu", 64, 8)               # the reference needs none: a no-op


# ----------------------------------------------------------------------------- the mixer

def _mixer_step(num_prefill):
    """One Mamba2Mixer step (3 decode rows of s=2, plus num_prefill prefill rows of 3 tokens) ->
    (output, the same step by the unfused ops, pools equal)."""
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.step.forward_batch import ForwardBatch, MambaMetadata
    from hybrid_engine.models.nemotron_h import Caches, Mamba2Mixer
    from hybrid_engine.mamba_cache.pool import MambaPool
    torch.manual_seed(0)
    cfg = ModelConfig(layer_types=("M",), vocab_size=16, hidden_size=32, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, intermediate_size=32, mamba_num_heads=4,
                      mamba_head_dim=8, n_groups=2, ssm_state_size=8, time_step_limit=(0.0, 2.0))
    mix = Mamba2Mixer(cfg, 0).to(torch.bfloat16)
    with torch.no_grad():
        for p in mix.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p is mix.norm.weight else 0.0))
    pools = [MambaPool(1, 8, cfg.conv_dim, cfg.conv_kernel, 4, 8, 8, 1, torch.bfloat16,
                       torch.device("cpu")) for _ in range(2)]
    for t in pools[0].conv_state + pools[0].ssm_state:
        t.copy_(torch.randn(t.shape))
    pools[1].conv_state[0].copy_(pools[0].conv_state[0])
    pools[1].ssm_state[0].copy_(pools[0].ssm_state[0])
    n, s = 3, 2
    nd, T = n * s, n * s + 3 * num_prefill
    qsl = tuple(range(0, 3 * num_prefill + 1, 3))
    md = MambaMetadata(n, s, torch.tensor([1, NULL_SLOT, 4]), torch.tensor([2, 1, 1]),
                       torch.tensor(qsl), qsl, torch.arange(5, 5 + num_prefill),
                       torch.ones(num_prefill, dtype=torch.bool))
    fb = ForwardBatch(torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long), None, md,
                      torch.arange(T))
    x = torch.randn(T, 32).to(torch.bfloat16)
    with torch.no_grad():
        out = mix(x, fb, Caches(None, pools[0]))
        # the unfused path, op by op
        conv, ssm = pools[1].conv_state[0], pools[1].ssm_state[0]
        z, xbc, dt = mix.in_proj(x).split([32, cfg.conv_dim, 4], dim=-1)
        wt, A = mix.conv1d.weight.squeeze(1), mix._A()
        c = mops.causal_conv1d_update(xbc[:nd].view(n, s, -1), wt, mix.conv1d.bias, conv,
                                      md.decode_slots, md.num_accepted)
        xd, bd, cd = c.split([32, 16, 16], dim=-1)
        y = mops.selective_state_update(ssm, xd.reshape(n, s, 4, 8), dt[:nd].view(n, s, 4),
                                        mix.dt_bias, A, bd.reshape(n, s, 2, 8),
                                        cd.reshape(n, s, 2, 8), mix.D, md.decode_slots,
                                        md.num_accepted, dt_limit=mix.dt_limit,
                                        out_dtype=torch.bfloat16)
        exp = mix.out_proj(mops.gated_rmsnorm(y.reshape(nd, 32), z[:nd], mix.norm.weight, 16,
                                              mix.eps))
    same = torch.equal(pools[0].ssm_state[0], ssm) and torch.equal(pools[0].conv_state[0], conv)
    return out, exp, same


def test_mixer_decode_only_step_uses_the_fused_op(monkeypatch):
    calls = []
    real = mops.selective_state_update_gated
    monkeypatch.setattr(mops, "selective_state_update_gated",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    out, exp, same_pool = _mixer_step(num_prefill=0)
    assert calls == [1]
    assert torch.equal(out, exp) and same_pool


def test_mixer_mixed_step_keeps_the_unfused_path(monkeypatch):
    monkeypatch.setattr(mops, "selective_state_update_gated",
                        lambda *a, **k: pytest.fail("fused op on a step with prefill rows"))
    out, exp, _ = _mixer_step(num_prefill=1)
    assert out.shape == (3 * 2 + 3, 32)
    # decode rows: the op-by-op numbers (out_proj over more rows may block the matmul otherwise)
    torch.testing.assert_close(out[:6], exp, rtol=2e-2, atol=2e-2)


def test_load_ahead_rule():
    """The state update loads a token's inputs one iteration ahead over several tokens only, and
    keeps the plain loop for float32 inputs above 4 rows (slower there on the H100)."""
    pytest.importorskip("triton")
    from hybrid_engine.mamba_cache.ops.triton_state_update import _load_ahead
    assert not _load_ahead(1, 1, torch.bfloat16) and not _load_ahead(1, 1, torch.float32)
    assert _load_ahead(2, 1, torch.float32) and _load_ahead(4, 4, torch.float32)
    assert not _load_ahead(4, 5, torch.float32) and not _load_ahead(4, 8, torch.float32)
    assert _load_ahead(4, 8, torch.bfloat16) and _load_ahead(2, 64, torch.float16)
