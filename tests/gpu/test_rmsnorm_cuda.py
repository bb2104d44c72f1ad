"""The model-side Triton kernels against their torch twins on CUDA (poisoned allocator, random
inputs; checks in model_kernel_cases.py): block RMSNorm, fused residual add + RMSNorm, relu².
The public dispatchers are called, so these also check that CUDA tensors reach the kernels."""
import logging

import pytest
import torch

import model_kernel_cases as mkc
from hybrid_engine.models.activation import relu2
from hybrid_engine.models.rmsnorm import (fused_add_rmsnorm, rmsnorm, rmsnorm_ref, rmsnorm_triton)
from hybrid_engine.mamba_cache.ops import triton_common

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DT_IDS = ["f32", "bf16", "f16"]
SHAPES = [(t, d) for t in (1, 3, 64, 1000) for d in (64, 1000, 4096)]


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("t, d", SHAPES)
def test_rmsnorm_triton_matches_ref(dtype, t, d):
    mkc.check_rmsnorm(rmsnorm, "cuda", dtype, t, d, seed=t * d)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("t, d", SHAPES)
def test_fused_add_rmsnorm_matches_ref(dtype, t, d):
    """Residual bitwise = torch's add; normed bitwise = the plain kernel on that residual."""
    mkc.check_add_rmsnorm(fused_add_rmsnorm, rmsnorm_triton, "cuda", dtype, t, d, seed=t + d)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("t, d", SHAPES + [(1, 21504), (7, 1)])
def test_relu2_bitwise_equals_torch(dtype, t, d):
    mkc.check_relu2(relu2, "cuda", dtype, t, d, seed=t * 7 + d)


def test_rmsnorm_triton_strided_rows():
    x = torch.randn(16, 256, device="cuda")[:, :128]          # row stride 256, unit inner stride
    w = torch.rand(128, device="cuda") + 0.5
    torch.testing.assert_close(rmsnorm_triton(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))


def test_fused_add_rmsnorm_strided_rows():
    """Row-strided views (e.g. a slice of a wider buffer) take the kernel and stay exact."""
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)[:, :128]
    r = torch.randn(16, 384, device="cuda", dtype=torch.bfloat16)[:, 100:228]
    w = torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5
    out, res = fused_add_rmsnorm(x, r, w, 1e-6)
    mkc.assert_bits(res, r + x, "residual")
    mkc.assert_bits(out, rmsnorm_triton(r + x, w, 1e-6), "normed")


def test_dispatch_picks_triton_and_logs_once(caplog):
    triton_common._logged.clear()
    x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(64, device="cuda", dtype=torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        for _ in range(2):
            rmsnorm(x, w, 1e-5)
            fused_add_rmsnorm(x, x, w, 1e-5)
            relu2(x)
    msgs = [r.getMessage() for r in caplog.records]
    for op in ("rmsnorm", "fused_add_rmsnorm", "relu2"):
        mine = [m for m in msgs if m.startswith(op + " backend")]
        assert mine == [f"{op} backend on cuda: triton"], (op, mine)
