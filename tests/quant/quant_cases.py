"""Quantized-weight linear kernels against their exact torch twins under Triton's interpreter: the
cases (shapes and configs) of the checks in ``quant_checks.py``. Run by
tests/quant/test_quant_kernels.py as a script under TRITON_INTERPRET=1, which prints ``CASE name
OK|FAIL``. The interpreter cases use float32 / float16 x (bf16 ``tl.dot`` is wrong in the interpreter).
"""
from __future__ import annotations

import os
import sys

import torch

# the checks (tests/gpu/test_quant_cuda.py runs them on CUDA)
from expert_checks import check_fp8_experts, check_fp8_experts_w8a8, check_nvfp4_experts
from quant_checks import (check_fp8, check_fp8_relu2, check_nvfp4, check_nvfp4_relu2,
                          check_nvfp4_x_range, check_nvfp4_zero_rows, check_zero_k,
                          check_fp8_every_code, check_quantize_rows, check_quantize_rows_bounded,
                          check_add_rmsnorm_fp8, check_fp8_rows_invariant, check_nvfp4_dequant_16bit)


FP8_FMA_SHAPES = [(1, 1, 5), (1, 37, 130), (1, 100, 1100)]
FP8_DOT_SHAPES = [(2, 37, 130), (3, 64, 96), (8, 100, 1100), (5, 1, 17)]
NVFP4_SHAPES = [(1, 33, 16), (2, 70, 48), (5, 1, 272), (8, 130, 544), (20, 40, 64), (70, 17, 32)]
NVFP4_FMA_SHAPES = [(1, 33, 16), (1, 70, 48), (1, 5, 272), (1, 130, 544)]   # groups not a multiple of BLOCK_G
NVFP4_ROWS_SHAPES = [(2, 33, 16), (3, 20, 48), (5, 19, 80), (8, 9, 272)]   # ROWS 2 / 4 / 8


def _cases():
    from hybrid_engine.quantization.fp8_kernels import fp8_skinny_linear, fp8_skinny_linear_dot, fp8_skinny_linear_fma
    from hybrid_engine.quantization.fp8_quantizer import quantize_rows_fp8
    from hybrid_engine.quantization.nvfp4_fma_kernels import nvfp4_skinny_linear_fma, nvfp4_skinny_linear_rows
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear, nvfp4_skinny_linear_dot
    cpu, f32, f16 = "cpu", torch.float32, torch.float16

    def run(fn, shapes, **kw):
        return lambda: max(fn(**kw, M=m, N=n, K=k, seed=i) for i, (m, n, k) in enumerate(shapes))

    def small(impl, **kw):
        return lambda x, w, s, b: impl(x, w, s, b, **kw)

    return {
        "fp8_fma_tensor": run(check_fp8, FP8_FMA_SHAPES, impl=small(fp8_skinny_linear_fma, block_n=8, block_k=64),
                              device=cpu, dtype=f32, per_channel=False),
        "fp8_fma_channel": run(check_fp8, FP8_FMA_SHAPES, impl=small(fp8_skinny_linear_fma, block_n=4, block_k=128),
                               device=cpu, dtype=f32, per_channel=True, bias=False),
        "fp8_fma_f16": run(check_fp8, FP8_FMA_SHAPES, impl=small(fp8_skinny_linear_fma, block_n=8, block_k=64),
                           device=cpu, dtype=f16, per_channel=True),
        # several rows through the one-row kernel (a grid row each): float32 dispatches every row
        # count there, so each row keeps a one-row launch's bits (relu² on load too)
        "fp8_fma_rows": run(check_fp8, [(3, 37, 130), (8, 100, 1100)], impl=small(fp8_skinny_linear_fma, block_n=8,
                                                                                 block_k=64),
                            device=cpu, dtype=f16, per_channel=True),
        "fp8_f32_rows_invariant": lambda: max(
            check_fp8_rows_invariant(impl, cpu, m, n, k, pc, relu2=r2, seed=m)
            for impl, (m, n, k, pc, r2) in [(small(fp8_skinny_linear_fma, block_n=8, block_k=64), (5, 37, 130, True, False)),
                                            (fp8_skinny_linear, (4, 40, 96, False, False)),
                                            (fp8_skinny_linear, (3, 24, 200, True, True))]),
        # every finite code (subnormals, +-448) exactly, at x far from 1 too (every product exact
        # in the dtype): the one-row and the 2-8-row kernels
        "fp8_every_code": lambda: max(
            check_fp8_every_code(impl, cpu, dt, xs)
            for impl in (small(fp8_skinny_linear_fma, block_n=8, block_k=64),
                         small(fp8_skinny_linear_dot, block_n=16, block_k=32))
            for dt, xs in ((f32, (1.0, 2.0 ** -60, 2.0 ** 60)), (f16, (1.0, 2.0 ** -13, 2.0 ** 5)))),
        "fp8_dot_tensor": run(check_fp8, FP8_DOT_SHAPES, impl=small(fp8_skinny_linear_dot, block_n=16, block_k=32),
                              device=cpu, dtype=f32, per_channel=False, bias=False),
        "fp8_dot_channel_f16": run(check_fp8, FP8_DOT_SHAPES, impl=small(fp8_skinny_linear_dot, block_n=16,
                                                                          block_k=64),
                                   device=cpu, dtype=f16, per_channel=True),
        # K in slices of whole 32-wide tiles (1100: 35 tiles asked for 4 slices -> 9 + 9 + 9 + 8;
        # 130: 5 tiles asked for 8 -> 5; 17: one tile, no split), per-tensor and per-channel scales
        "fp8_dot_slices": lambda: max(
            check_fp8(impl=lambda x, w, s, b, ks=ks: fp8_skinny_linear_dot(x, w, s, b, block_n=16, block_k=32,
                                                                         k_slices=ks),
                      device=cpu, dtype=f32, M=m, N=n, K=k, per_channel=pc, seed=i)
            for i, (m, n, k, ks, pc) in enumerate([(8, 100, 1100, 4, True), (2, 37, 130, 8, False),
                                                   (5, 1, 17, 3, True)])),
        # the 2-8-row dispatch with K in slices: 4 at N <= 2048, 3 at N <= 8192 (K >= 4096)
        "fp8_dispatch_slices": run(check_fp8, [(2, 40, 4096), (5, 2100, 4096)], impl=fp8_skinny_linear,
                                   device=cpu, dtype=f16, per_channel=True),
        "fp8_dispatch": run(check_fp8, [(m, 40, 96) for m in range(1, 9)], impl=fp8_skinny_linear,
                            device=cpu, dtype=f16, per_channel=True),
        "fp8_fma_relu2": run(check_fp8_relu2, FP8_FMA_SHAPES, impl=lambda x, w, s, b, **k: fp8_skinny_linear_fma(
            x, w, s, b, block_n=8, block_k=64, **k), device=cpu, dtype=torch.bfloat16, per_channel=True),
        # the dispatcher: relu² on load for one row, the relu² kernel then the dot kernel for more
        "fp8_dispatch_relu2": run(check_fp8_relu2, [(m, 40, 96) for m in range(1, 9)] + [(5, 2100, 4096), (8, 40, 4100)],
                                  impl=fp8_skinny_linear, device=cpu, dtype=f16, per_channel=True),
        "nvfp4_dot": run(check_nvfp4, NVFP4_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_dot(
            x, p, s, g, b, block_n=16, block_w=4), device=cpu, dtype=f32),
        "nvfp4_dot_swap": run(check_nvfp4, NVFP4_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_dot(
            x, p, s, g, b, block_n=16, block_w=2, swap=True), device=cpu, dtype=f32),
        # K in slices of whole tiles, the last one partial (68 words: 24 + 24 + 20; 34: 10 x 3 + 4;
        # 8 words in tiles of 4 asked for 5 slices: 2), added by the slice sum with the bias
        "nvfp4_dot_slices": lambda: max(
            check_nvfp4(impl=lambda x, p, s, g, b, kw=kw: nvfp4_skinny_linear_dot(x, p, s, g, b, **kw),
                        device=cpu, dtype=dt, M=m, N=n, K=k, seed=i)
            for i, (m, n, k, dt, kw) in enumerate([
                (3, 40, 544, f32, dict(block_n=16, block_w=4, k_slices=3)),
                (20, 17, 272, f16, dict(block_n=16, block_w=2, swap=True, k_slices=4)),
                (2, 9, 64, f32, dict(block_n=16, block_w=4, k_slices=5))])),
        "nvfp4_dot_f16": run(check_nvfp4, NVFP4_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_dot(
            x, p, s, g, b, block_n=32, block_w=4), device=cpu, dtype=f16, bias=False),
        "nvfp4_dot_swap_f16": run(check_nvfp4, NVFP4_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_dot(
            x, p, s, g, b, block_n=16, block_w=4, swap=True), device=cpu, dtype=f16),
        "nvfp4_fma": run(check_nvfp4, NVFP4_FMA_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_fma(
            x, p, s, g, b, block_n=8, block_g=4), device=cpu, dtype=f32),
        "nvfp4_fma_f16": run(check_nvfp4, NVFP4_FMA_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_fma(
            x, p, s, g, b, block_n=16, block_g=2), device=cpu, dtype=f16, bias=False),
        # the persistent kernel: a grid of 3 (2) programs over 1-17 (3-65) row tiles in all, with and
        # without the next tile's loads in flight (past N on the last tile)
        "nvfp4_fma_persistent": run(check_nvfp4, NVFP4_FMA_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_fma(
            x, p, s, g, b, block_n=8, block_g=None, pipeline=True, programs=3), device=cpu, dtype=f32),
        "nvfp4_fma_persistent_f16": run(check_nvfp4, NVFP4_FMA_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_fma(
            x, p, s, g, b, block_n=2, block_g=None, programs=2), device=cpu, dtype=f16, bias=False),
        "nvfp4_fma_persistent_x_range": lambda: max(check_nvfp4_x_range(
            lambda x, p, s, g: nvfp4_skinny_linear_fma(x, p, s, g, block_n=4, block_g=None, pipeline=True, programs=5),
            cpu, f32, 24, 160, lo, hi) for lo, hi in ((-7, -7), (6, 6), (-8, 8), (36, 36))),
        # K in 2-4 slices, a program a slice, the float32 sums added by a second launch: slices of
        # 12 / 2 / 5 / 1 groups (the last ones partial; (1, 33, 16)'s second slice holds no group)
        "nvfp4_fma_persistent_slices": lambda: max(
            check_nvfp4(impl=lambda x, p, s, g, b, kw=kw: nvfp4_skinny_linear_fma(x, p, s, g, b, block_g=None, **kw),
                        device=cpu, dtype=f32, M=1, N=n, K=k, seed=i)
            for i, (n, k, kw) in enumerate([(130, 544, dict(block_n=4, k_slices=3, programs=6, pipeline=True)),
                                            (70, 48, dict(block_n=8, k_slices=2, programs=4)),
                                            (5, 272, dict(block_n=2, k_slices=4, programs=9, pipeline=True)),
                                            (33, 16, dict(block_n=8, k_slices=2, programs=2))])),
        # the one-row dispatch at each kind of _fma_config: persistent in one slice (K 64, 8192) and in
        # slices (8208: 2 slices, the second of one group)
        "nvfp4_dispatch_one_row": run(check_nvfp4, [(1, 40, 64), (1, 9, 8192), (1, 9, 8208)], impl=nvfp4_skinny_linear,
                                      device=cpu, dtype=f32),
        # the multi-row dispatch: the rows kernel (2 rows; 3-4 at N <= 2048), else the dot kernel
        # with the weight on the MMA's M side and K in slices (N 40 at 6 rows: 8 asked, 4 whole
        # tiles; N 2100: 4 asked, 2 tiles; above 32 rows)
        "nvfp4_dispatch_rows": run(check_nvfp4, [(2, 40, 64), (4, 40, 64), (6, 40, 512), (3, 2100, 256), (40, 24, 32)],
                                   impl=nvfp4_skinny_linear, device=cpu, dtype=f32),
        "nvfp4_rows": run(check_nvfp4, NVFP4_ROWS_SHAPES, impl=lambda x, p, s, g, b: nvfp4_skinny_linear_rows(
            x, p, s, g, b, block_n=8, block_g=4), device=cpu, dtype=f32),
        "nvfp4_rows_f16": run(check_nvfp4, NVFP4_ROWS_SHAPES[1:3], impl=lambda x, p, s, g, b: nvfp4_skinny_linear_rows(
            x, p, s, g, b, block_n=4, block_g=2), device=cpu, dtype=f16, bias=False),
        "nvfp4_fma_x_range": lambda: max(check_nvfp4_x_range(
            lambda x, p, s, g: nvfp4_skinny_linear_fma(x, p, s, g, block_n=8, block_g=4), cpu, f32, 24, 160, lo, hi)
            for lo, hi in ((-7, -7), (6, 6), (-8, 8), (36, 36))),
        # the rows kernel applies the global scale at the end (like the dot kernel): no 1e36 case
        "nvfp4_rows_x_range": lambda: max(check_nvfp4_x_range(
            lambda x, p, s, g: nvfp4_skinny_linear_rows(x, p, s, g, block_n=8, block_g=4), cpu, f32, 12, 96, lo, hi,
            M=3)
            for lo, hi in ((-8, 8), (20, 20))),
        "nvfp4_zero_rows": lambda: check_nvfp4_zero_rows(cpu),
        # relu² as the persistent one-row kernel loads x (one slice, and K in 3 slices), and the
        # dispatch: the one-row kernel, the relu² kernel first for more rows
        "nvfp4_persistent_relu2": lambda: max(
            check_nvfp4_relu2(lambda x, p, s, g, b, kw=kw, **k: nvfp4_skinny_linear_fma(
                x, p, s, g, b, block_g=None, programs=3, **kw, **k), cpu, dt, 1, n, kk, seed=i)
            for i, (dt, n, kk, kw) in enumerate([(f32, 33, 272, dict(block_n=4)), (f16, 20, 160, dict(block_n=2)),
                                                 (f32, 9, 96, dict(block_n=4, k_slices=3, pipeline=True)),
                                                 (torch.bfloat16, 33, 272, dict(block_n=4)),
                                                 (torch.bfloat16, 9, 96, dict(block_n=4, k_slices=3, pipeline=True))])),
        "nvfp4_dispatch_relu2": run(check_nvfp4_relu2, [(1, 40, 64), (3, 40, 64)], impl=nvfp4_skinny_linear,
                                    device=cpu, dtype=f16),
        "dot_zero_k": lambda: check_zero_k(cpu),
        "fp8_quantize_rows": lambda: check_quantize_rows(quantize_rows_fp8, cpu, block_k=256),
        "fp8_add_rmsnorm": lambda: check_add_rmsnorm_fp8(cpu, torch.bfloat16, 5, 96),
        "fp8_rmsnorm_no_residual": lambda: check_add_rmsnorm_fp8(cpu, f32, 3, 40, seed=1, residual=False),
        "fp8_quantize_rows_one_pass": lambda: check_quantize_rows(quantize_rows_fp8, cpu, block_k=2048),
        "fp8_quantize_rows_relu2": lambda: check_quantize_rows(quantize_rows_fp8, cpu, block_k=256, relu2=True),
        "fp8_quantize_rows_relu2_one_pass": lambda: check_quantize_rows(quantize_rows_fp8, cpu, block_k=2048,
                                                                        relu2=True),
        "fp8_experts_decode": lambda: check_fp8_experts(cpu, f32, 3, 6, 2, 40, 24, grouped=False),
        # one token: FP8 experts' down projection takes its own tile there (moe_tiles.gemv_tiles)
        "fp8_experts_decode_one": lambda: check_fp8_experts(cpu, f32, 1, 6, 3, 40, 600, grouped=False, seed=2),
        "fp8_experts_grouped": lambda: check_fp8_experts(cpu, f32, 11, 6, 3, 40, 24, grouped=True, seed=1),
        # W8A8 grouped path: FP8 rows and FP8 dots (exact in the interpreter); 16 experts > T k leaves some
        # empty. float16 only: the interpreter's float32 -> bfloat16 cast truncates, so the bfloat16
        # epilogue (MODEL_BF16) is checked by tests/gpu/test_quant_cuda.py::test_fp8_experts_w8a8
        "fp8_experts_w8a8": lambda: max(check_fp8_experts_w8a8(cpu, f16, 11, 6, 3, 40, 24),
                                        check_fp8_experts_w8a8(cpu, f16, 9, 16, 2, 72, 40, seed=3)),
        "fp8_experts_w8a8_one_expert": lambda: check_fp8_experts_w8a8(cpu, f16, 10, 5, 2, 40, 24, seed=1,
                                                                      one_expert=True),
        "fp8_experts_w8a8_swiglu": lambda: check_fp8_experts_w8a8(cpu, f16, 9, 6, 2, 40, 24, seed=2, swiglu=True),
        "fp8_quantize_rows_bounded": lambda: check_quantize_rows_bounded(cpu),
        # NVFP4 experts: the decode kernel at the rule's tiles (1 and 5 tokens; 16 experts > T k leave some
        # without tokens) and at tiles of 8 groups (F = 272: the down projection in three K tiles, the last
        # ragged), and the grouped GEMM (float32 and float16 rows; 2 K steps of the up projection at D = 192)
        "nvfp4_experts_decode": lambda: max(
            check_nvfp4_experts(cpu, f32, 1, 6, 2, 48, 64, path="gemv"),
            check_nvfp4_experts(cpu, f16, 5, 16, 2, 48, 32, path="gemv", seed=1)),
        "nvfp4_experts_looped": lambda: check_nvfp4_experts(cpu, f32, 1, 6, 2, 48, 272, path="gemv",
                                                            decode_tiles=(16, 8, 4)),
        # the prefill path's decode to 16 bits: N and K ragged against the 4-row x 64-group (1024-input)
        # tiles; K 1296 (81 groups) takes two K tiles, the second partial
        "nvfp4_dequant_16bit": lambda: max(check_nvfp4_dequant_16bit(cpu, dt, n, k, seed=i) for i, (dt, n, k) in
                                           enumerate([(torch.bfloat16, 37, 272), (f16, 16, 512), (f32, 5, 16),
                                                      (torch.bfloat16, 7, 1296)])),
        "nvfp4_experts_grouped": lambda: max(check_nvfp4_experts(cpu, f32, 11, 6, 3, 192, 48, path="grouped", seed=2),
                                             check_nvfp4_experts(cpu, f16, 9, 16, 2, 64, 32, path="grouped", seed=3)),
        "nvfp4_experts_one_expert": lambda: check_nvfp4_experts(cpu, f32, 10, 5, 2, 48, 32, path="grouped", seed=4,
                                                                one_expert=True),
        "nvfp4_experts_swiglu": lambda: max(check_nvfp4_experts(cpu, f32, 3, 6, 2, 48, 32, path="gemv", seed=5,
                                                                swiglu=True),
                                            check_nvfp4_experts(cpu, f32, 3, 6, 2, 48, 32, path="gemv", seed=7,
                                                                swiglu=True, decode_tiles=(8, 4, 4)),
                                            check_nvfp4_experts(cpu, f32, 9, 6, 2, 48, 32, path="grouped", seed=6,
                                                                swiglu=True)),
    }


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before starting"
    torch.set_num_threads(1)
    from triton_interpret import case_main
    cases = _cases()
    sys.exit(case_main(cases, sys.argv[1:], run=lambda case: f"result {case():.3g}"))
