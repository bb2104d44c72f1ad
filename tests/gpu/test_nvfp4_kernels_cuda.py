"""NVFP4 weight-only decode kernels on CUDA (FP8-capable GPU: Ada / Hopper) against their exact
float32 twin (tests/quant/quant_checks.py: poisoned outputs, ragged rows, odd widths) in bf16 and
fp16: the one-row FMA kernels (looped, persistent, in K slices), the 2-8-row kernel, the dot
kernel at the dispatch rule and in K slices, relu² on load, x ranges, and every code and block
scale decoded exactly; the fused MoE with NVFP4 experts (tests/quant/expert_checks.py). The FP8
kernels and the engine paths: test_quant_cuda.py."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
import expert_checks as ec  # noqa: E402
import quant_checks as qc  # noqa: E402
from hybrid_engine.quantization.nvfp4 import nvfp4_linear  # noqa: E402
from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear, nvfp4_skinny_linear_dot  # noqa: E402
from test_quant_cuda import SHAPES  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16, F16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def _fp8_gpu(monkeypatch):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an FP8-capable GPU")


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(1, 4096, 21504), (1, 1000, 2688), (2, 4096, 21504), (8, 4096, 21504)],
                         ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_nvfp4_relu2_on_load(shape, dtype):
    """The NVFP4 dispatch with relu2: at one row the persistent kernel applies relu² as it loads x
    (3 slices at K 21504), more rows run the relu² kernel first; bit for bit the projection of
    relu2_ref(x)."""
    m, n, k = shape
    qc.check_nvfp4_relu2(nvfp4_skinny_linear, DEV, dtype, m, n, k, seed=m + n)
    if m == 8:                          # above 128 rows: the prefill path (the relu² kernel first)
        qc.check_nvfp4_relu2(nvfp4_linear, DEV, dtype, 200, 1000, 2688, seed=1)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
def test_nvfp4_prefill_rows(dtype):
    """Above 128 rows (prefill) the weight is dequantized without its global scale, so the cuBLAS
    sums are ~1 / weight_scale_2 times the real outputs: with float16 x they once overflowed to inf
    at real outputs of a few units (here ~50, O(1) weights); cuBLAS now writes them in float32."""
    qc.check_nvfp4(nvfp4_linear, DEV, dtype, 300, 1000, 2688, seed=3)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[2] % 16 == 0] + [(5, 1, 272)],
                         ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_nvfp4_kernel(shape, dtype):
    m, n, k = shape
    qc.check_nvfp4(nvfp4_skinny_linear, DEV, dtype, m, n, k, seed=m + n)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("M,N", [(1, 64), (1, 16424), (2, 64), (2, 16424), (4, 100), (8, 64), (8, 16424), (3, 70000),
                                 (20, 100), (70, 20000)],
                         ids=lambda v: str(v))
def test_nvfp4_decode_is_exact_for_every_code_and_scale(M, N, dtype):
    """One-hot x rows: each output is one dequantized weight (a single nonzero product), so the
    kernels' PTX decode must give it exactly: every byte value in both nibbles, block scales over
    the whole e4m3 range from 0 through the subnormals to 448, the FMA kernels (one row, rows) and
    the dot kernel as the dispatch runs them (the weight on the MMA's M side, K permuted within each
    word, in slices; row tiles), and the dot kernel with x on the M side (no dispatch rule takes it)
    at 8 and 20 rows."""
    from hybrid_engine.quantization.nvfp4 import dequantize_nvfp4
    K = 256
    g = torch.Generator().manual_seed(N + M)
    packed = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    bs = torch.randint(0, 127, (N, K // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    bs.view(torch.uint8).view(-1)[:127] = torch.arange(127, dtype=torch.int32).to(torch.uint8)
    gs = torch.tensor(1.0)
    want = dequantize_nvfp4(packed, bs, gs).t().to(dtype).to(DEV)              # [K, N], exact in dtype
    p, s, g1 = packed.to(DEV), bs.to(DEV), gs.to(DEV)
    eye = torch.eye(K, dtype=dtype, device=DEV)
    impls = [nvfp4_skinny_linear]
    if M in (8, 20):
        impls.append(lambda *a: nvfp4_skinny_linear_dot(*a, block_n=32, block_w=32, swap=False))
    for impl in impls:
        for k0 in range(0, K, M):
            rows = eye[k0:k0 + M]
            y = impl(rows, p, s, g1)
            assert torch.equal(y, want[k0:k0 + rows.shape[0]]), f"inputs {k0}..{k0 + rows.shape[0] - 1}"


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(2, 4096, 8192), (8, 1024, 4096), (8, 18560, 4096), (32, 4096, 4096),
                                   (32, 21504, 4096), (128, 4096, 1024), (5, 33, 272), (8, 4096, 21504),
                                   (8, 4096, 8192)],
                         ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_nvfp4_dot_kernel_at_the_rule(shape, dtype):
    """The multi-row dispatch at its configs (the rows kernel; the dot kernel with the weight on the
    MMA's M side, K in slices, 16/32/64-row tiles) against the float32 twin."""
    m, n, k = shape
    qc.check_nvfp4(nvfp4_skinny_linear, DEV, dtype, m, n, k, seed=n + m)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,config", [((8, 4096, 21504), dict(block_n=32, block_w=32, k_slices=4)),
                                          ((32, 4096, 8192), dict(block_n=32, block_w=32, k_slices=3)),
                                          ((64, 1000, 2688), dict(block_n=64, block_w=32, swap=True, k_slices=2)),
                                          ((5, 33, 272), dict(block_n=16, block_w=4, k_slices=3)),
                                          ((20, 17, 272), dict(block_n=64, block_w=2, swap=True, k_slices=4))],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v.get("k_slices")))
def test_nvfp4_dot_kernel_k_slices(shape, config, dtype):
    """The dot kernel with K in slices (float32 partial sums added in slice order with the bias),
    both operand orders, a last slice shorter than the others, against the float32 twin."""
    m, n, k = shape
    qc.check_nvfp4(lambda *a: nvfp4_skinny_linear_dot(*a, **config), DEV, dtype, m, n, k, seed=n + m)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(1, 4096, 4096), (1, 18560, 4096), (1, 4096, 21504), (1, 33, 16), (1, 5, 272)],
                         ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
@pytest.mark.parametrize("config", [dict(block_n=4, block_g=256), dict(block_n=8, block_g=128),
                                    dict(block_n=8, block_g=32, num_warps=8)], ids=["4x256", "8x128", "8x32"])
def test_nvfp4_fma_kernel_one_row(shape, dtype, config):
    """The looped one-row FMA kernel (int32 words, nibble pairs decoded into float16 pairs, packed
    float16 products per group) at the dispatch rule's config for K > 8192 (8 x 128), its earlier one
    (4 x 256) and a small tile, against the float32 twin (ragged rows and partial group tiles
    included)."""
    from hybrid_engine.quantization.nvfp4_fma_kernels import nvfp4_skinny_linear_fma
    m, n, k = shape
    qc.check_nvfp4(lambda *a: nvfp4_skinny_linear_fma(*a, **config), DEV, dtype, m, n, k, seed=n)


_PERSIST = dict(plain=dict(block_n=4, block_g=None),
                pipelined=dict(block_n=2, block_g=None, programs_per_sm=8, pipeline=True),
                few_programs=dict(block_n=4, block_g=None, num_warps=8, programs=7, pipeline=True),
                slices=dict(block_n=2, block_g=None, k_slices=3, pipeline=True))


@pytest.mark.parametrize("shape,dtype,config", [
    ((1, 18560, 4096), BF16, "plain"), ((1, 18560, 4096), BF16, "pipelined"), ((1, 18560, 4096), BF16, "few_programs"),
    ((1, 4096, 8192), BF16, "plain"), ((1, 4096, 8192), F16, "plain"), ((1, 33, 16), BF16, "pipelined"),
    ((1, 33, 16), F16, "few_programs"), ((1, 1000, 2688), BF16, "pipelined"), ((1, 1000, 2688), BF16, "few_programs"),
    ((1, 4096, 21504), BF16, "slices"), ((1, 1000, 2688), F16, "slices")],
    ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_nvfp4_fma_persistent_kernel(shape, dtype, config):
    """The persistent one-row kernel (x prepared once per program, whole-row tiles walked by a
    fixed grid; 7 programs: hundreds of tiles each) at the dispatch rule's configs, and with K in 3
    slices (8B down_proj: 448 groups a slice), against the float32 twin: ragged N, group counts
    that are not powers of two (17, 168)."""
    from hybrid_engine.quantization.nvfp4_fma_kernels import nvfp4_skinny_linear_fma
    m, n, k = shape
    qc.check_nvfp4(lambda *a: nvfp4_skinny_linear_fma(*a, **_PERSIST[config]), DEV, dtype, m, n, k, seed=n + k)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(2, 4096, 4096), (2, 4096, 21504), (3, 18560, 4096), (4, 1024, 4096), (5, 33, 272),
                                   (8, 4096, 8192), (7, 5, 16)], ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
@pytest.mark.parametrize("config", [dict(block_n=4, block_g=256), dict(block_n=8, block_g=64)], ids=["4x256", "8x64"])
def test_nvfp4_rows_kernel(shape, dtype, config):
    """The 2-8-row kernel (the weight decoded once per tile, each row's x prepared as in the one-row
    kernel) at the dispatch rule's two configs, against the float32 twin: 2, 4 and 8 row variants
    with padding rows (3, 5, 7), ragged N, partial group tiles."""
    from hybrid_engine.quantization.nvfp4_fma_kernels import nvfp4_skinny_linear_rows
    m, n, k = shape
    qc.check_nvfp4(lambda *a: nvfp4_skinny_linear_rows(*a, **config), DEV, dtype, m, n, k, seed=n + m)


@pytest.mark.parametrize("dtype,lo,hi", [(BF16, -7, -7), (BF16, 6, 6), (BF16, -8, 8), (F16, -4, -4), (F16, 3, 3),
                                         (F16, -4, 3)], ids=lambda v: str(v))
def test_nvfp4_fma_kernel_x_range(dtype, lo, hi):
    """x groups whose products e2m1 * 2^-14 * x would fall below float16's subnormals (x ~ 1e-7,
    1e-4) or above its largest value (bf16 x up to 1e8): each group's power of two keeps its
    float16 products accurate and finite. (fp16 x stays >= 1e-4: smaller outputs are float16
    subnormals themselves, coarser than the tolerance whatever the kernel does.)"""
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear
    qc.check_nvfp4_x_range(nvfp4_skinny_linear, DEV, dtype, 4096, 4096, lo, hi, seed=lo + 100 * hi)


@pytest.mark.parametrize("M,lo,hi", [(2, -8, 8), (3, 6, 6), (4, -7, -7)], ids=lambda v: str(v))
def test_nvfp4_rows_kernel_x_range(M, lo, hi):
    """The same x ranges through the 2-4-row dispatch (the rows kernel), each row its own groups."""
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear
    qc.check_nvfp4_x_range(nvfp4_skinny_linear, DEV, BF16, 4096, 4096, lo, hi, seed=M, M=M)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("T,E,k,path,kind", [
    (1, 128, 6, "gemv", "ragged"), (3, 128, 6, "gemv", "ragged"), (8, 16, 6, "gemv", "ragged"),
    (24, 128, 6, "gemv", "ragged"), (9, 16, 6, "grouped", "ragged"), (25, 128, 6, "grouped", "ragged"),
    (200, 128, 6, "grouped", "ragged"), (64, 16, 6, "grouped", "one_expert"), (300, 512, 22, "grouped", "ragged"),
    (4, 16, 2, "gemv", "swiglu"), (40, 16, 2, "grouped", "swiglu")])
def test_nvfp4_experts(T, E, k, path, kind, dtype):
    """NVFP4 experts in the fused MoE against the float32 twin on the dequantized weights: the
    pair GEMVs (up to 24 tokens) and the grouped GEMM at the Nano-30B-A3B widths (D 2688, F 1856)
    with 16 or its 128 experts, top-6; Super's 512 experts top-22 and SwiGLU at narrower widths;
    every token on one expert."""
    D, F = (2688, 1856) if E <= 128 and kind != "swiglu" else (1024, 512)
    ec.check_nvfp4_experts(DEV, dtype, T, E, k, D, F, path, seed=T, swiglu=kind == "swiglu",
                           one_expert=kind == "one_expert")


@pytest.mark.parametrize("T,path", [(1, "gemv"), (24, "gemv"), (200, "grouped")])
def test_nvfp4_experts_float32_rows(T, path):
    """A float32 model's NVFP4 experts stay exact on CUDA: the pair GEMVs take the float32 decode
    and FMAs (the packed float16 products of 16-bit rows would leave ~4e-4), the grouped GEMM
    tf32x3 dots; against the float32 twin within 1e-5."""
    ec.check_nvfp4_experts(DEV, torch.float32, T, 16, 6, 2688, 1856, path, seed=T)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", [(4096, 4096), (1000, 2688), (37, 272)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_nvfp4_dequant_16bit(shape, dtype):
    """The prefill path's one-pass decode to 16 bits equals its torch twin bit for bit on CUDA
    (every byte and finite block-scale code)."""
    qc.check_nvfp4_dequant_16bit(DEV, dtype, *shape, seed=shape[0])
