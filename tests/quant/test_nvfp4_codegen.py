"""The NVFP4 decode kernels' CUDA paths (``PTX=True``: the inline PTX decode, packed float16 FMAs and
x pairs) compile for sm_90 on the CPU. The interpreter cases run the float32 twins (``PTX=False``),
and their launches are the ones ``test_launched_kernels_compile_for_sm90`` compiles, so without this
test the PTX strings and their operand lists would first be compiled on a GPU."""
import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybrid_engine.quantization.nvfp4_fma_kernels import _nvfp4_fma_kernel, _nvfp4_rows_kernel  # noqa: E402
from hybrid_engine.quantization.nvfp4_persistent import _nvfp4_fma_persistent_kernel  # noqa: E402

ALIGNED = ("x_ptr", "w_ptr", "bs_ptr", "y_ptr", "KW", "swn", "sbn", "sxm", "sym")


def _compile(kernel, dtype, consts, num_warps=4, num_stages=3):
    sig = dict(x_ptr=f"*{dtype}", w_ptr="*i32", bs_ptr="*fp8e4nv", gs_ptr="*fp32", b_ptr=f"*{dtype}",
               y_ptr=f"*{dtype}", M="i32", N="i32", KW="i32", sxm="i32", swn="i32", sbn="i32", sym="i32",
               n_tiles="i32", part_ptr="*fp32", KW_S="i32")
    sig = {n: sig.get(n, "constexpr") for n in kernel.arg_names}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED if n in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("block_n,block_g", [(4, 256), (8, 128)])
def test_one_row_kernel_compiles_with_ptx(dtype, block_n, block_g):
    ptx = _compile(_nvfp4_fma_kernel, dtype, dict(HAS_BIAS=True, BLOCK_N=block_n, BLOCK_G=block_g, PTX=True,
                                                  PDL=True))
    # 8 packed FMAs per group and element; no flush-to-zero (the decode's e = 0 values are subnormal)
    assert len(re.findall(r"fma\.rn\.f16x2", ptx)) >= 8 and "cvt.rn.f16x2.f32" in ptx
    assert not re.search(r"f16x2?\.ftz|\.ftz\.f16", ptx)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("block_n,groups,num_warps,pipeline,slices", [
    (2, 256, 4, True, 1), (4, 256, 8, True, 1), (4, 512, 4, False, 1), (2, 168, 4, False, 1), (2, 448, 4, True, 3)])
def test_persistent_kernel_compiles_with_ptx(dtype, block_n, groups, num_warps, pipeline, slices):
    for relu2 in (False, True):        # relu² as x loads: the relu² MLP's down_proj (8B: 3 slices)
        ptx = _compile(_nvfp4_fma_persistent_kernel, dtype,
                       dict(NG=groups * slices, NG_S=groups, NG_PAD=1 << (groups - 1).bit_length(), SLICES=slices,
                            HAS_BIAS=True, BLOCK_N=block_n, PIPELINE=pipeline, PTX=True, RELU2=relu2,
                            BF16_BITS=False, PDL=True), num_warps=num_warps)
        assert len(re.findall(r"fma\.rn\.f16x2", ptx)) >= 8 and "cvt.rn.f16x2.f32" in ptx
        assert not re.search(r"f16x2?\.ftz|\.ftz\.f16", ptx)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("rows,block_n,block_g", [(2, 4, 256), (4, 8, 64), (8, 8, 64)])
def test_rows_kernel_compiles_with_ptx(dtype, rows, block_n, block_g):
    ptx = _compile(_nvfp4_rows_kernel, dtype, dict(HAS_BIAS=True, ROWS=rows, BLOCK_N=block_n, BLOCK_G=block_g,
                                                   PTX=True, PDL=True))
    # each row: one mul and 7 FMAs per group and element
    assert len(re.findall(r"mul\.rn\.f16x2", ptx)) >= rows
    assert len(re.findall(r"fma\.rn\.f16x2", ptx)) >= 7 * rows


def _dot_rule_configs():
    """Every distinct dot-kernel launch the dispatch rule makes on the 8B shapes at 3-128 rows (row
    tile, tile, operand order, stages, sliced or not), and the x-on-the-M-side form the sweeps use."""
    from hybrid_engine.mamba_cache.ops.triton_common import cdiv
    from hybrid_engine.quantization.nvfp4_kernels import _dot_config
    out = {(16, 32, 32, False, 3, True)}
    for N, K in [(18560, 4096), (4096, 8192), (21504, 4096), (4096, 21504), (4096, 4096), (1024, 4096),
                 (131072, 4096)]:
        for M in (3, 8, 20, 32, 64, 128):
            c = _dot_config(M, N, K)
            bm = 16 if M <= 16 else (32 if M <= 32 else 64)
            kw = K // 8
            kw_s = cdiv(cdiv(kw, c["k_slices"]), c["block_w"]) * c["block_w"]
            out.add((bm, c["block_n"], c["block_w"], c["swap"], c["num_stages"], cdiv(kw, kw_s) > 1))
    return sorted(out)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("block_m,block_n,block_w,swap,stages,split", _dot_rule_configs())
def test_dot_kernel_compiles_with_ptx(dtype, block_m, block_n, block_w, swap, stages, split):
    """The dot kernel at every config the dispatch rule (``_dot_config``) launches on the 8B shapes:
    the PTX decode (one packed scale FMA per pair), the permuted-K joins and x's permute, the
    tensor-core MMA, and K in slices (float32 partial sums stored)."""
    from hybrid_engine.quantization.nvfp4_kernels import _nvfp4_dot_kernel
    ptx = _compile(_nvfp4_dot_kernel, dtype, dict(HAS_BIAS=True, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_W=block_w,
                                                  SWAP=swap, SHIFT=8 if dtype == "bf16" else 7, PTX=True,
                                                  SPLIT=split),
                   num_stages=stages)
    assert len(re.findall(r"fma\.rn\.f16x2" if dtype == "fp16" else r"fma\.rn\.bf16x2", ptx)) >= 4
    assert re.search(r"wgmma|mma\.sync", ptx)


def _compile_experts(kernel, dtype, out_dtype, consts, num_warps, num_stages=3, w_dtype="i32"):
    """An NVFP4 experts kernel (``quantization/nvfp4_experts.py``) compiled for sm_90 -> its PTX."""
    sig = dict(a_ptr=f"*{dtype}", w_ptr=f"*{w_dtype}", b_ptr="*fp8e4nv", gs_ptr="*fp32", ids_ptr="*i32",
               out_ptr=f"*{out_dtype}", sorted_ptr="*i32", block_e_ptr="*i32", nrows_ptr="*i32")
    sig = {n: sig.get(n, "i32" if n in ("N", "KW", "KB", "A_DIV", "num_pairs") or n.startswith("s_") else "constexpr")
           for n in kernel.arg_names}
    aligned = ("a_ptr", "w_ptr", "b_ptr", "out_ptr", "KW", "KB", "s_am", "s_we", "s_wn", "s_be", "s_bn", "s_om")
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in kernel.arg_names}
    return triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages)).asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("rows_per_tile", [16, 32, 64, 128])
def test_nvfp4_grouped_experts_compile(dtype, rows_per_tile):
    """The NVFP4 experts' grouped GEMM at every row tile ``moe_align.align_block_size`` picks, with
    its tiles (``grouped_config``), up (relu², and SwiGLU) and down: the decoded halves
    meet the rows' even and odd columns on the tensor cores. The interpreter's launches reach only
    16-row tiles, and an earlier form of this kernel failed Triton 3.6's TTGIR passes at 128 rows
    on the H200 (2026-11-29; this compiles with the installed Triton only)."""
    import torch
    from hybrid_engine.quantization.nvfp4_experts import _nvfp4_grouped_gemm_kernel, grouped_config
    cfg = grouped_config(rows_per_tile, torch.bfloat16 if dtype == "bf16" else torch.float16)
    for up, swiglu in ((True, False), (True, True), (False, False)):
        consts = dict(A_SORTED=not up, OUT_SORTED=up, RELU2=up and not swiglu, SWIGLU=swiglu,
                      F32=False, BLOCK_M=rows_per_tile, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"])
        ptx = _compile_experts(_nvfp4_grouped_gemm_kernel, dtype, dtype, consts,
                               cfg["num_warps"], cfg["num_stages"], w_dtype="u8")
        assert re.search(r"wgmma|mma\.sync", ptx)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_nvfp4_expert_decode_compiles_with_ptx(dtype):
    """The NVFP4 experts' decode GEMV at the rule's tiles: packed float16 FMAs, no flush-to-zero."""
    from hybrid_engine.quantization.nvfp4_experts import DECODE_TILES, _nvfp4_pair_gemv_kernel
    bn, bg, warps = DECODE_TILES
    for relu2, swiglu in ((True, False), (False, False), (False, True)):
        ptx = _compile_experts(_nvfp4_pair_gemv_kernel, dtype, dtype,
                               dict(RELU2=relu2, SWIGLU=swiglu, BLOCK_N=bn, BLOCK_G=bg, PTX=True,
                                    PDL=True), warps)
        assert len(re.findall(r"fma\.rn\.f16x2", ptx)) >= 8 and "cvt.rn.f16x2.f32" in ptx
        assert not re.search(r"f16x2?\.ftz|\.ftz\.f16", ptx)
