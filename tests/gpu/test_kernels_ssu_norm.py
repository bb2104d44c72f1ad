"""The state update fused with the gated norm (CONTRACT item 6) on CUDA: the public op vs its torch
twin (kernel_cases.check_ssu_norm: two launches in a row, counters back at zero, null rows finite)
over dtypes, token counts, spec depths, Nemotron-like groups and launch options; then a CUDA graph
of the op replayed twice on new inputs; the load-ahead loop and the deferred update (item 4b)
against the plain checkpointed kernel, bit for bit."""
import functools
import logging

import pytest
import torch

import kernel_cases as kc
import ssu_deferred_cases as sdc
from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops import (selective_state_update_gated, selective_state_update_gated_ref,
                             triton_common, triton_state_update)

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16]
DT_IDS = ["f32", "bf16"]


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)


def test_dispatch_picks_triton_and_logs_once(caplog):
    triton_common._logged.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        for _ in range(2):
            kc.check_ssu_norm(selective_state_update_gated, DEV, torch.bfloat16, 3, 2, 1)
    mine = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("selective_state_update_gated backend")]
    assert mine == ["selective_state_update_gated backend on cuda: triton"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("K", range(9))
def test_ssu_norm_all_k(dtype, K):
    for s in sorted({1, K + 1, max(1, K // 2)}):
        kc.check_ssu_norm(selective_state_update_gated, DEV, dtype, 5, s, K, seed=K + s)


SSU_NORM = [
    dict(N=1, s=1, K=0),
    dict(N=6, s=3, K=4, dt_limit=(0.01, 0.3), z_3d=True),
    dict(N=4, s=2, K=2, H=6, G=3, P=24, Nst=24),                  # P not a power of two
    dict(N=128, s=1, K=0, H=16, G=2, P=64, Nst=128),              # 8 heads per group (512 ch)
    dict(N=128, s=4, K=3, H=16, G=2, P=64, Nst=128),
    dict(N=37, s=5, K=8, H=16, G=2, P=64, Nst=128),               # ragged s < 1+K
    dict(N=33, s=2, K=1, H=128, G=8, P=64, Nst=128),              # Nemotron-H 8B: group 1024
    dict(N=7, s=2, K=1, H=8, G=2, P=64, Nst=16, norm_groups=4),   # norm groups != SSM groups
    dict(N=5, s=2, K=1, H=4, G=2, P=16, norm_groups=8),           # half a head: two kernels
]


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=DT_IDS + ["f16"])
@pytest.mark.parametrize("case", range(len(SSU_NORM)))
def test_ssu_norm(dtype, case):
    kc.check_ssu_norm(selective_state_update_gated, DEV, dtype, seed=case, **SSU_NORM[case])


@pytest.mark.parametrize("block_p,num_warps,block_s", [(8, 1, None), (16, 2, 1), (32, 8, 2),
                                                       (64, 4, None)])
def test_ssu_norm_launch_options(block_p, num_warps, block_s):
    """Several head_dim blocks per head (more programs per group than heads), other warps, and
    fewer tokens per step of the norm (s = 5 with 2 per step: a short last step)."""
    from hybrid_engine.mamba_cache.ops.triton_state_update import triton_selective_state_update_gated
    impl = functools.partial(triton_selective_state_update_gated, block_p=block_p,
                             num_warps=num_warps, block_s=block_s)
    for dtype in DTYPES:
        for case in (2, 4, 5, 7):
            kc.check_ssu_norm(impl, DEV, dtype, seed=block_p + case, **SSU_NORM[case])


def test_counters_are_not_allocated_during_capture(monkeypatch):
    from hybrid_engine.mamba_cache.ops import triton_state_update as tsu
    tsu.reserve_ssu_norm_counters(DEV, 4, 2)
    have = tsu._counters[torch.device(DEV, torch.cuda.current_device())].numel()
    monkeypatch.setattr(tsu.torch.cuda, "is_current_stream_capturing", lambda: True)
    tsu.reserve_ssu_norm_counters(DEV, have, 1)                     # fits: no allocation
    with pytest.raises(RuntimeError, match="reserve_ssu_norm_counters"):
        tsu.reserve_ssu_norm_counters(DEV, have + 1, 1)


def test_ssu_norm_cuda_graph():
    """Capture the op (after an eager call sized the counters), then replay twice with new inputs
    copied into the static buffers: each replay equals the reference, counters end at zero."""
    torch.manual_seed(0)
    dt, N, s, K, H, G, P, Nst = torch.bfloat16, 48, 4, 3, 16, 2, 64, 64
    I, gs = H * P, H * P // G
    rnd = lambda *sh: torch.randn(*sh, device=DEV).to(dt)           # noqa: E731

    def fresh():
        slots = torch.randperm(2 * N, device=DEV)[:N].int() + 1
        slots[3] = NULL_SLOT                                        # a null row
        return dict(x=rnd(N, s, H, P), dt=rnd(N, s, H) * 0.5, B=rnd(N, s, G, Nst),
                    C=rnd(N, s, G, Nst), zbig=rnd(N * s, I + 8), slots=slots,
                    acc=torch.randint(1, K + 2, (N,), device=DEV, dtype=torch.int32),
                    pool=torch.randn(2 * N + 1, 1 + K, H, P, Nst, device=DEV))
    st = fresh()                                                    # the static buffers
    dt_bias, A, D = rnd(H).float() - 1, -torch.rand(H, device=DEV) - 0.5, rnd(H)
    w = 1 + 0.1 * rnd(I)

    def run(fn, pool):
        return fn(pool, st["x"], st["dt"], dt_bias, A, st["B"], st["C"], D, st["slots"], st["acc"],
                  st["zbig"][:, 3:3 + I], w, gs, 1e-5, (0.0, 2.0))
    run(selective_state_update_gated, st["pool"].clone())          # eager: compiles, sizes
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(selective_state_update_gated, st["pool"])
    for rep in range(2):
        for k, v in fresh().items():
            st[k].copy_(v)
        p_ref = st["pool"].clone()
        ref = run(selective_state_update_gated_ref, p_ref)
        kc.poison_allocator(DEV)
        g.replay()
        torch.cuda.synchronize()
        ok = st["slots"] != NULL_SLOT
        kc.assert_close(out[ok], ref[ok], kc.TOL["norm"][dt] + kc._ULP[dt] + 1e-4,
                        f"graph replay {rep}")
        kc.assert_pool(st["pool"], p_ref, 1e-4, f"graph replay {rep} state")
        assert kc.ssu_norm_counters_zero()


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=DT_IDS + ["f16"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_ssu_load_ahead_is_bitwise_the_loop(dtype, gated):
    """Next-token load-ahead (taken at s > 1) against the plain loop, both forced, on CUDA: the
    same y and checkpoints bit for bit at 1, 3 and 8 rows and 2-5 tokens, on a Nemotron-like
    head shape (head_dim 64, d_state 128) and a small odd one."""
    for N, s, K, shape in ((1, 4, 3, dict(H=32, G=4, P=64, Nst=128)), (8, 2, 1, dict(H=16, G=2, P=64, Nst=128)),
                           (3, 5, 8, dict(H=6, G=3, P=24, Nst=24))):
        kc.check_ssu_load_ahead_bitwise(DEV, dtype, N, s, K, gated, seed=N + s, **shape)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=DT_IDS + ["f16"])
@pytest.mark.parametrize("gated", [False, True], ids=["plain", "gated"])
def test_deferred_state_update_is_bitwise_the_checkpointed(dtype, gated):
    """CONTRACT item 4b on CUDA: the kernel on a deferred pool (one state a slot, replaying the
    accepted pending tokens) against the kernel on a checkpointed pool, over random verify steps
    and accepted counts: y and the state bit for bit (the replay and the token loop share
    ``_advance``), dead slots (their states and pending inputs) untouched. Nemotron-like heads (head_dim
    64, d_state 128: 4 head_dim blocks, so 4 copies of dt and B) at 1 and 8 rows, and a small odd
    shape with the dt clamp; the load-ahead loop (16-bit, s > 1) and the plain one both occur."""
    op = (triton_state_update.triton_selective_state_update_gated if gated
          else triton_state_update.triton_selective_state_update)
    for N, K, shape, lim in ((1, 3, dict(H=32, G=4, P=64, Nst=128), (0.0, float("inf"))),
                             (8, 4, dict(H=16, G=2, P=64, Nst=128), (0.0, float("inf"))),
                             (5, 2, dict(H=6, G=3, P=24, Nst=24), (0.01, 0.4))):
        sdc.check_ssu_deferred(op, DEV, dtype, N, K, steps=6, gated=gated, dt_limit=lim, seed=N + K, **shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_deferred_public_gated_op_takes_two_kernels_for_a_verify(dtype, monkeypatch):
    """The public gated op on a deferred pool: a verify (s > 1) runs the unfused state update (2
    warps a program) and the standalone norm; states bit for bit the checkpointed fused kernel's,
    outputs within the norm's tolerance of it."""
    from hybrid_engine.mamba_cache.ops import triton_norm
    launched = []
    real = triton_norm.triton_gated_rmsnorm
    monkeypatch.setattr(triton_norm, "triton_gated_rmsnorm", lambda *a, **k: launched.append(1) or real(*a, **k))
    tol = kc.TOL["norm"][dtype] + kc._ULP.get(dtype, 0.0)
    sdc.check_ssu_deferred(selective_state_update_gated, DEV, dtype, 8, 3, steps=6, gated=True, seed=11,
                          out_tol=tol, H=16, G=2, P=64, Nst=128)
    assert launched, "a deferred verify did not take the two-kernel path"
