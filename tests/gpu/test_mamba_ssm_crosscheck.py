"""Cross-check our SSD scan and selective_state_update against mamba-ssm's Triton kernels (CUDA).

mamba-ssm is an optional reference, never a dependency: install its pure-python wheel (built with
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE, --no-build-isolation) with --no-deps.  Its package __init__ imports the compiled
``selective_scan_cuda`` (Mamba-1 only), so ``mamba_ssm_ref.load_mamba_ssm`` puts an empty stub module in
``sys.modules`` first; the Triton ops need only torch, triton, einops and packaging.  The tests
skip when mamba-ssm (or CUDA) is not available.

Tolerances: fp32 inputs.  mamba-ssm's chunk scan runs its fp32 ``tl.dot`` in TF32 (about 1e-3
relative error against the exact recurrence, per the notes), so the SSD comparison allows 5e-3
(max|a-e| / max|e|) and also checks each side against our float32 sequential oracle.  The
single-token state update has no dots: 1e-4.
"""
from __future__ import annotations

import pytest
import torch

from hybrid_engine.mamba_cache.ops import selective_state_update, ssd_scan_naive, ssd_scan_varlen
from hybrid_engine.mamba_cache.ops.mamba_ssm_ref import load_mamba_ssm as _load_mamba_ssm

pytestmark = pytest.mark.gpu

SSD_TOL = 5e-3
SSU_TOL = 1e-4


def load_mamba_ssm():
    """-> (mamba_chunk_scan_combined, selective_state_update) from mamba-ssm, or skip."""
    scan, ssu, why = _load_mamba_ssm()
    if why is not None:
        pytest.skip(f"mamba-ssm not importable: {why}")
    return scan, ssu


def rel_err(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.double(), e.double()
    assert a.shape == e.shape, (a.shape, e.shape)
    assert bool(torch.isfinite(a).all()) and bool(torch.isfinite(e).all())
    return float((a - e).abs().max()) / max(float(e.abs().max()), 1e-6)


@pytest.fixture(scope="module")
def mamba_ops():
    if not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    return load_mamba_ssm()


def _ssd_inputs(lens, H, P, G, N, seed, init_scale):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(lens)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).cuda()
    x, dt_raw = r(T, H, P), r(T, H, scale=0.5)
    dt_bias = r(H, scale=0.5) - 1.0
    A = -torch.exp(r(H, scale=0.5))
    B, C = r(T, G, N), r(T, G, N)
    D = r(H)
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32).cuda()
    init = r(len(lens), H, P, N, scale=init_scale)
    return x, dt_raw, dt_bias, A, B, C, D, qsl, init


@pytest.mark.parametrize("lens,chunk,init_scale", [
    ([300], 128, 1.0),                 # one sequence with an initial state
    ([1000], 128, 0.0),
    ([37, 200, 130, 5, 64], 128, 0.0),  # varlen, packed (mamba-ssm: seq_idx + cu_seqlens)
    ([129, 1, 256], 128, 0.0),
])  # one chunk size: mamba-ssm autotunes per chunk_size (about 30 s per new key on an H100)
def test_ssd_vs_mamba_ssm(mamba_ops, lens, chunk, init_scale):
    chunk_scan, _ = mamba_ops
    H, P, G, N = 8, 64, 2, 128
    x, dt_raw, dt_bias, A, B, C, D, qsl, init = _ssd_inputs(lens, H, P, G, N, seed=len(lens) + chunk,
                                                            init_scale=init_scale)
    y, final = ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, qsl, init, chunk)
    y_o, final_o = ssd_scan_naive(x, dt_raw, dt_bias, A, B, C, D, qsl, init)

    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True)
    if len(lens) == 1:
        out, ms_final = chunk_scan(x[None], dt_raw[None], A, B[None], C[None], chunk,
                                   initial_states=init, return_final_states=True, **kw)
    else:   # mamba-ssm: initial state only for the first packed sequence -> zeros here
        seq_idx = torch.repeat_interleave(torch.arange(len(lens), device="cuda"),
                                          torch.tensor(lens, device="cuda")).to(torch.int32)[None]
        out, ms_final = chunk_scan(x[None], dt_raw[None], A, B[None], C[None], chunk,
                                   seq_idx=seq_idx, cu_seqlens=qsl, return_varlen_states=True,
                                   **kw)
    out = out[0]
    errs = {"y": rel_err(y, out), "final": rel_err(final, ms_final),
            "ours_vs_oracle_y": rel_err(y, y_o), "mamba_vs_oracle_y": rel_err(out, y_o),
            "ours_vs_oracle_final": rel_err(final, final_o),
            "mamba_vs_oracle_final": rel_err(ms_final, final_o)}
    print(f"ssd {lens} chunk={chunk}: " + ", ".join(f"{k}={v:.2e}" for k, v in errs.items()))
    assert errs["y"] <= SSD_TOL and errs["final"] <= SSD_TOL, errs


@pytest.mark.parametrize("nrows,H,P,G,N", [(5, 8, 64, 2, 128), (64, 16, 64, 8, 128), (3, 4, 32, 4, 16)])
def test_state_update_vs_mamba_ssm(mamba_ops, nrows, H, P, G, N):
    _, ms_ssu = mamba_ops
    g = torch.Generator(device="cpu").manual_seed(nrows + H)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).cuda()
    S = 2 * nrows + 1                                 # pool with K=0: [S, 1, H, P, N]
    pool = r(S, 1, H, P, N)
    slots = (torch.randperm(S - 1, generator=g)[:nrows] + 1).to(torch.int32).cuda()
    x, dt_raw = r(nrows, 1, H, P), r(nrows, 1, H, scale=0.5)
    dt_bias, A, D = r(H, scale=0.5) - 1.0, -torch.exp(r(H, scale=0.5)), r(H)
    B, C = r(nrows, 1, G, N), r(nrows, 1, G, N)
    acc = torch.ones(nrows, dtype=torch.int32, device="cuda")

    ours_pool = pool.clone()
    y = selective_state_update(ours_pool, x, dt_raw, dt_bias, A, B, C, D, slots, acc)

    # mamba-ssm: state (pool, H, P, N) updated in place at state_batch_indices; per-head scalars
    # passed as the expanded (stride-0) views Mamba2 uses (its "tied" fast path)
    ms_state = pool[:, 0].clone()
    out = ms_ssu(ms_state, x[:, 0], dt_raw[:, 0, :, None].expand(nrows, H, P),
                 A[:, None, None].expand(H, P, N), B[:, 0], C[:, 0],
                 D=D[:, None].expand(H, P), z=None, dt_bias=dt_bias[:, None].expand(H, P),
                 dt_softplus=True, state_batch_indices=slots)
    e_y = rel_err(y[:, 0], out)
    e_s = rel_err(ours_pool[:, 0], ms_state)
    print(f"ssu nrows={nrows} H={H} P={P} G={G} N={N}: y={e_y:.2e} state={e_s:.2e}")
    assert e_y <= SSU_TOL and e_s <= SSU_TOL, (e_y, e_s)
    untouched = torch.ones(S, dtype=torch.bool, device="cuda")
    untouched[slots.long()] = False
    assert torch.equal(ours_pool[untouched], pool[untouched])
