"""The Triton block RMSNorm against its torch reference (poisoned output, random inputs)."""
import pytest
import torch

from hybrid_engine.models.rmsnorm import rmsnorm_ref, rmsnorm_triton

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("t, d", [(1, 64), (7, 4096), (300, 512), (33, 1000)])
def test_rmsnorm_triton_matches_ref(dtype, tol, t, d):
    g = torch.Generator(device="cuda").manual_seed(t * d)
    x = (torch.randn(t, d, device="cuda", generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(d, device="cuda", generator=g)).to(dtype)
    out = rmsnorm_triton(x, w, 1e-5)
    ref = rmsnorm_ref(x, w, 1e-5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_rmsnorm_triton_strided_rows():
    x = torch.randn(16, 256, device="cuda")[:, :128]          # row stride 256, unit inner stride
    w = torch.rand(128, device="cuda") + 0.5
    torch.testing.assert_close(rmsnorm_triton(x, w, 1e-6), rmsnorm_ref(x, w, 1e-6))
