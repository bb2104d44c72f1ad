"""Decode-sized projections on CUDA (``models/skinny_linear.py`` and the ``models.linear.Linear``
dispatch): each kernel and the dispatcher's route against F.linear in float64, and the float32
rows' batch invariance. Split from test_kernels.py (the Mamba, norm and attention kernels)."""
import pytest
import torch

import kernel_cases as kc
import linear_cases as lc

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DT_IDS = ["f32", "bf16", "f16"]


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)


LINEAR = [(1, 37, 100), (1, 4096, 4096), (1, 1024, 4096), (1, 18560, 4096), (1, 4096, 21504),
          (2, 200, 333), (4, 4096, 8192), (4, 21504, 4096), (8, 1000, 1024), (16, 65, 129),
          (2, 1024, 4096), (3, 1024, 4096), (8, 1024, 4096), (2, 4096, 21504)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", range(len(LINEAR)))
def test_skinny_linear(dtype, case):
    """The dispatcher's choice for M rows (FMA kernel for 1 row; for 2..16 ``_multi_row_route``: the
    dot kernel, the FMA kernel (small k/v-like shapes up to 4 rows) or cuBLAS (long rows); float32:
    the FMA kernel for 1..8) and both kernels directly, with and without bias, against F.linear in
    float64."""
    from hybrid_engine.models.skinny_linear import (skinny_linear, skinny_linear_dot, skinny_linear_f32,
                                                    skinny_linear_fma)
    M, N, K = LINEAR[case]
    impls = [skinny_linear, skinny_linear_dot] + ([skinny_linear_fma] if M <= 8 else [])
    impls += [skinny_linear_f32] if dtype == torch.float32 and M <= 8 else []
    for seed, impl in enumerate(impls):
        lc.check_linear(impl, DEV, dtype, M, N, K, bias=seed % 2 == 0, seed=seed)


RELU2 = [(1, 4096, 21504), (2, 4096, 21504), (4, 4096, 21504), (8, 4096, 21504), (1, 37, 100), (4, 130, 300)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("M,N,K", RELU2)
def test_skinny_linear_relu2_on_load(dtype, M, N, K):
    """The relu² MLP's down_proj at decode (``linear(..., relu2=True)``): the FMA kernel applies
    relu² as it loads x, the dot and cuBLAS routes run the relu² kernel first; each bit for bit the
    projection of relu2_ref(x), and close to it in float64."""
    from hybrid_engine.models.skinny_linear import skinny_linear, skinny_linear_f32, skinny_linear_fma
    impls = [skinny_linear, skinny_linear_fma]
    impls += [skinny_linear_f32] if dtype == torch.float32 else []
    for seed, impl in enumerate(impls):
        lc.check_linear_relu2(impl, DEV, dtype, M, N, K, bias=seed % 2 == 0, seed=seed)


@pytest.mark.parametrize("M,N,K", [(4, 4096, 4096), (8, 1000, 1024), (3, 18560, 4096), (4, 16384, 1024),
                                   (8, 5152, 600)])
def test_skinny_linear_f32_rows_are_batch_invariant(M, N, K):
    """float32 decode-sized projections: a row's result is the same bits alone or among M rows."""
    from hybrid_engine.models.skinny_linear import skinny_linear_f32
    lc.check_linear_rows_invariant(skinny_linear_f32, DEV, M, N, K, seed=M)


def test_linear_module_dispatch():
    """models.linear.Linear: Triton for decode-sized 16-bit inputs, F.linear otherwise; the
    same numbers either way (within bf16 rounding)."""
    from hybrid_engine.models.linear import Linear
    torch.manual_seed(0)
    lin = Linear(256, 512, bias=True).to(DEV, torch.bfloat16)
    for rows in (1, 4, 8, 9, 64):
        x = torch.randn(rows, 256, device=DEV, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.double(), lin.weight.double(), lin.bias.double())
        kc.assert_close(lin(x).double(), ref, 1e-2, f"Linear rows={rows}")
    from hybrid_engine.models.skinny_linear import skinny_linear_f32
    f32 = Linear(64, 32).to(DEV)
    for rows in (1, 4, 8):                        # float32 decode-sized rows: the FMA kernel
        x = torch.randn(rows, 64, device=DEV)
        assert torch.equal(f32(x), skinny_linear_f32(x, f32.weight, f32.bias))
        kc.assert_close(f32(x).double(), torch.nn.functional.linear(x.double(), f32.weight.double(),
                                                                    f32.bias.double()), 1e-5, "f32 Linear")
    x = torch.randn(9, 64, device=DEV)            # more rows: cuBLAS
    assert torch.equal(f32(x), torch.nn.functional.linear(x, f32.weight, f32.bias))
