"""Quantized-weight kernels and formats on CPU.

- The Triton FP8 / NVFP4 decode kernels and the fused MoE with FP8 / NVFP4 experts under Triton's interpreter (quant_cases.py: poisoned
  outputs, ragged rows, odd widths) against their exact float32 twins.
- The formats against hand-written expectations, not our own encoder: e2m1 code table and nibble
  order, float8 scales, and that quantize -> dequantize is exact on representable values and within
  half a step elsewhere.
"""
import math
from pathlib import Path

import pytest
import torch

from hybrid_engine.quantization.fp8 import (FP8, dequantize_fp8, fp8_linear, fp8_linear_ref,
                                            fp8_scaled_mm_ref, quantize_activations, quantize_fp8)
from hybrid_engine.quantization.nvfp4 import dequantize_nvfp4, quantize_nvfp4, unpack_e2m1
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases

HERE = Path(__file__).resolve().parent
CASES = ["fp8_fma_tensor", "fp8_fma_channel", "fp8_fma_f16", "fp8_fma_rows", "fp8_f32_rows_invariant", "fp8_every_code", "fp8_dot_tensor", "fp8_dot_channel_f16", "fp8_dot_slices", "fp8_dispatch_slices",
         "fp8_dispatch", "fp8_quantize_rows", "fp8_quantize_rows_one_pass", "fp8_quantize_rows_relu2",
         "fp8_quantize_rows_relu2_one_pass", "fp8_add_rmsnorm", "fp8_rmsnorm_no_residual", "nvfp4_dot", "nvfp4_dot_swap", "nvfp4_dot_slices", "nvfp4_dot_f16", "nvfp4_dot_swap_f16", "nvfp4_fma", "nvfp4_fma_f16", "nvfp4_fma_x_range", "nvfp4_fma_persistent", "nvfp4_fma_persistent_f16",
         "nvfp4_fma_persistent_x_range", "nvfp4_fma_persistent_slices", "nvfp4_dispatch_one_row", "nvfp4_dispatch_rows", "nvfp4_rows", "nvfp4_rows_f16", "nvfp4_rows_x_range", "nvfp4_zero_rows", "dot_zero_k", "nvfp4_persistent_relu2", "nvfp4_dispatch_relu2", "fp8_experts_decode", "fp8_experts_decode_one",
         "fp8_experts_grouped", "fp8_fma_relu2", "fp8_dispatch_relu2", "fp8_experts_w8a8", "fp8_experts_w8a8_one_expert",
         "fp8_experts_w8a8_swiglu", "fp8_quantize_rows_bounded", "nvfp4_experts_decode", "nvfp4_experts_looped", "nvfp4_experts_grouped", "nvfp4_dequant_16bit",
         "nvfp4_experts_one_expert", "nvfp4_experts_swiglu"]


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases(HERE / "quant_cases.py")


@pytest.mark.parametrize("case", CASES)
def test_kernel_under_interpreter(interpreter_results, case):
    assert_case(interpreter_results, case)


def test_every_case_of_the_script_is_asserted(interpreter_results):
    """A case added to quant_cases.py but not to CASES would run and never be checked."""
    ran = {k for k in interpreter_results if not k.startswith("_")}
    assert ran == set(CASES), (sorted(ran - set(CASES)), sorted(set(CASES) - ran))


def test_w8a8_expert_dots_promote_their_partial_sums(interpreter_results):
    """The W8A8 grouped GEMM, compiled for sm_90 as the cases launched it, keeps ``PROMOTE_K`` on
    every FP8 dot: without it Triton's sm_90 default (2^30) lets the tensor cores accumulate a
    whole K in their reduced precision, a 9.8e-3 error against float32 sums at Nano widths where
    promotion every 128 products gave 3.6e-3 (H200, 2026-11-29), too close to tell apart by
    tolerance in a CUDA test. This reads the compiled kernel on the CPU instead."""
    import re
    from triton_interpret import compile_launch_for_sm90
    launches = [r for r in interpreter_results["_launches"]
                if r["name"] == "_grouped_gemm_kernel" and r["constexprs"].get("A_SCALED")]
    assert {r["constexprs"]["SWIGLU"] for r in launches} == {False, True}, "the cases launch both activations"
    for rec in launches:
        promote, block_k = rec["constexprs"]["PROMOTE_K"], rec["constexprs"]["BLOCK_K"]
        assert promote % 32 == 0 and block_k % promote == 0, rec["constexprs"]
        ttir = compile_launch_for_sm90(rec).asm["ttir"]
        dots = [line for line in ttir.splitlines() if "tt.dot " in line]
        assert len(dots) == (2 if rec["constexprs"]["SWIGLU"] else 1), dots
        for line in dots:
            assert re.search(rf"maxNumImpreciseAcc = {promote}\b", line), line


def test_launched_kernels_compile_for_sm90(interpreter_results):
    """The kernels as the cases launched them also compile for the GPU (the interpreter skips
    the compiler's checks)."""
    assert_compiles_for_sm90(interpreter_results)


# ------------------------------------------------------------------------------------ formats

def test_e2m1_table_and_nibble_order():
    # byte 0x2F: low nibble 0xF = -6 (element 0), high nibble 0x2 = +1 (element 1)
    # byte 0x9B: low 0xB = -1.5, high 0x9 = -0.5; byte 0x70: low 0 = 0, high 7 = 6
    packed = torch.tensor([[0x2F, 0x9B, 0x70]], dtype=torch.uint8)
    assert unpack_e2m1(packed).tolist() == [[-6.0, 1.0, -1.5, -0.5, 0.0, 6.0]]


def test_e2m1_every_byte_value_with_the_sign_of_zero():
    """All 256 bytes, both nibbles, against the format's table written out here: value and sign
    bit (code 8 is -0.0; a list comparison alone would take 0.0 for it)."""
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None]      # [1, 256]
    got = unpack_e2m1(packed)[0]                                             # [512]
    want = torch.tensor([table[b & 0xF] if i == 0 else table[b >> 4] for b in range(256) for i in (0, 1)])
    assert torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))


def test_nvfp4_dequantize_by_hand():
    # 32 inputs = 2 blocks; block scales 0.5 and 3.0 (exact in e4m3), global scale 0.25
    codes = torch.arange(32) % 16                       # every code twice
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)[None]
    bs = torch.tensor([[0.5, 3.0]]).to(FP8)
    table = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6]
    want = torch.tensor([table[c] * (0.5 if i < 16 else 3.0) * 0.25 for i, c in enumerate(codes.tolist())])
    got = dequantize_nvfp4(packed, bs, torch.tensor(0.25))
    assert torch.equal(got[0], want)


def test_nvfp4_round_trip():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g)
    packed, bs, gs = quantize_nvfp4(w)
    assert packed.shape == (24, 32) and packed.dtype == torch.uint8
    assert bs.shape == (24, 4) and bs.dtype == FP8 and gs.shape == () and gs.dtype == torch.float32
    assert math.isclose(float(gs), float(w.abs().max()) / (6 * 448), rel_tol=1e-6)
    deq = dequantize_nvfp4(packed, bs, gs)
    # each value lands on the nearest of its block's grid: error <= half the largest e2m1 step (1.0)
    step = bs.float().repeat_interleave(16, 1) * gs
    assert ((deq - w).abs() <= step * 1.0 + 1e-6).all()
    # a weight already on the grid comes back exactly
    packed2, bs2, gs2 = quantize_nvfp4(deq)
    assert torch.equal(dequantize_nvfp4(packed2, bs2, gs2), deq)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_round_trip(per_channel):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 40, generator=g) * torch.rand(16, 1, generator=g)
    w_q, s = quantize_fp8(w, per_channel)
    amax = w.abs().amax(1) if per_channel else w.abs().amax()
    assert torch.equal(s, amax / 448) and w_q.dtype == FP8
    deq = dequantize_fp8(w_q, s)
    assert torch.equal(deq, w_q.float() * (s[:, None] if per_channel else s))
    # e4m3 has 3 mantissa bits: relative rounding error <= 2^-4 on normal values
    sc = s[:, None] if per_channel else s
    normal = (w / sc).abs() >= 2 ** -6
    assert (((deq - w).abs() <= w.abs() * 2 ** -4 + 1e-12) | ~normal).all()
    assert w_q.float().abs().max() == 448                # the amax element maps to e4m3's max


def test_fp8_cpu_dispatch_is_the_exact_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 32, generator=g).to(torch.bfloat16)
    w_q, s = quantize_fp8(torch.randn(24, 32, generator=g), True)
    y = fp8_linear(x, w_q, s)
    assert y.shape == (3, 5, 24) and y.dtype == torch.bfloat16
    want = (x.float().reshape(-1, 32) @ (w_q.float() * s[:, None]).T).to(torch.bfloat16).view(3, 5, 24)
    assert torch.equal(y, want)
    assert torch.equal(fp8_linear_ref(x.reshape(-1, 32), w_q, s), want.view(-1, 24))


def _relu2_mlp(quantized_linear, seed):
    """A relu² MLP (32 -> 48 -> 32, O(1) weights) whose down_proj is ``quantized_linear`` made from
    its 16-bit one, with the down_proj's ``forward_relu2`` recording each input shape in ``calls``."""
    from hybrid_engine.models.layers import MLP
    g = torch.Generator().manual_seed(seed)
    mlp = MLP(32, 48)
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    mlp.down_proj = quantized_linear.quantized_from(mlp.down_proj)
    calls = []
    hook = mlp.down_proj.forward_relu2
    mlp.down_proj.forward_relu2 = lambda h: calls.append(h.shape) or hook(h)
    return mlp, calls, g


@torch.no_grad()
def test_relu2_mlp_hands_the_activation_to_an_nvfp4_down_proj():
    """The relu² MLP gives its up projection's output to an ``Nvfp4Linear`` down_proj's
    ``forward_relu2`` (the one-row CUDA kernel applies relu² as it loads x); on CPU that equals
    down_proj(relu2(h)) exactly, at one row and at several."""
    from hybrid_engine.models.activation import relu2_ref
    from hybrid_engine.quantization.linear import Nvfp4Linear
    mlp, calls, g = _relu2_mlp(Nvfp4Linear, seed=6)
    for rows in (1, 7):
        x = torch.randn(rows, 32, generator=g)
        y = mlp(x)
        h = mlp.up_proj(x)
        assert torch.equal(y, mlp.down_proj(relu2_ref(h)))
        assert not torch.equal(y, mlp.down_proj(h))              # the activation really was applied
    assert calls == [(1, 48), (7, 48)]


@torch.no_grad()
def test_relu2_mlp_hands_the_activation_to_an_fp8_down_proj():
    """The relu² MLP gives its up projection's output to an ``Fp8Linear`` down_proj's
    ``forward_relu2`` (which applies relu² inside the W8A8 quantizer on CUDA); on CPU that equals
    down_proj(relu2(h)) exactly, and the CPU twin of the W8A8 path quantizes relu2(h)."""
    from hybrid_engine.models.activation import relu2_ref
    from hybrid_engine.quantization.fp8 import fp8_scaled_mm
    from hybrid_engine.quantization.linear import Fp8Linear
    mlp, calls, g = _relu2_mlp(Fp8Linear, seed=5)
    x = torch.randn(7, 32, generator=g)
    y = mlp(x)
    assert calls == [(7, 48)]
    h = mlp.up_proj(x)
    assert torch.equal(y, mlp.down_proj(relu2_ref(h)))
    assert not torch.equal(y, mlp.down_proj(h))                  # the activation really was applied
    w, ws = mlp.down_proj.weight, mlp.down_proj.weight_scale
    assert torch.equal(fp8_scaled_mm(h, w, ws, relu2=True), fp8_scaled_mm(relu2_ref(h), w, ws))
    seen = []                                    # a forward hook (calibration) sees relu2(h) as input
    mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    assert torch.equal(mlp(x), y) and len(calls) == 1 and torch.equal(seen[0], relu2_ref(h))


def test_w8a8_reference_quantizes_activations():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=g) * 3
    w_q, s = quantize_fp8(torch.randn(8, 32, generator=g), False)
    xq, xs = quantize_activations(x, None)                # dynamic: per token
    assert xs.shape == (4, 1) and torch.equal(xs[:, 0], x.abs().amax(1) / 448)
    y = fp8_scaled_mm_ref(x, w_q, s)
    want = (xq.float() * xs) @ (w_q.float() * s).T
    assert torch.equal(y, want)
    static = torch.tensor(0.005)                          # |x| up to ~10: 10 / 0.005 > 448
    xq2, xs2 = quantize_activations(x, static)            # static: saturates at 448 * scale
    assert xs2.shape == () and float(xq2.float().abs().max()) == 448


@pytest.mark.parametrize("shape", [(), (1,), (24,), (24, 1)])
def test_fp8_stored_scale_shapes(shape):
    """Scales as checkpoints store them (per tensor [] / [1], per channel [N] / [N, 1])."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 32, generator=g)
    w_q = torch.randn(24, 32, generator=g).to(FP8)
    s = torch.rand(shape, generator=g) + 0.5
    want = x @ (w_q.float() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))).T
    torch.testing.assert_close(fp8_linear(x, w_q, s), want, rtol=1e-6, atol=1e-6)


def test_quantize_rows_refuses_bad_inputs():
    """The prefill quantizer names what is wrong before any launch: a per-channel input_scale, or x
    that is not [M, K] with a unit inner stride."""
    from hybrid_engine.quantization.fp8_quantizer import quantize_rows_fp8
    x = torch.randn(3, 32)
    with pytest.raises(ValueError, match="input_scale must have one element"):
        quantize_rows_fp8(x, torch.ones(32))
    with pytest.raises(ValueError, match=r"x must be \[M, K\] with a unit inner stride"):
        quantize_rows_fp8(x.t())
    with pytest.raises(ValueError, match=r"x must be \[M, K\]"):
        quantize_rows_fp8(x[None])


def test_nvfp4_kernels_refuse_unaligned_packed_rows():
    """Both NVFP4 kernels read the packed weight as int32 words: a weight whose rows do not start
    on 4-byte boundaries is refused by name before any launch (the loader's weights are
    contiguous, K / 2 a multiple of 8)."""
    from hybrid_engine.quantization.nvfp4_fma_kernels import nvfp4_skinny_linear_fma
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear_dot
    p, bs, gs = quantize_nvfp4(torch.randn(4, 32))
    x = torch.randn(1, 32, dtype=torch.bfloat16)
    for width in (33, 20):                 # row stride 33: not a multiple of 4; 20: offsets 1-3
        wide = torch.zeros(4, width, dtype=torch.uint8)
        for off in (1, 2, 3):
            view = wide[:, off:off + 16]
            view.copy_(p)
            with pytest.raises(ValueError, match="4-byte boundaries"):
                nvfp4_skinny_linear_fma(x, view, bs, gs)
            with pytest.raises(ValueError, match="4-byte boundaries"):
                nvfp4_skinny_linear_dot(x.expand(3, 32), view, bs, gs)


def test_nvfp4_persistent_kernel_refuses_long_rows():
    """The persistent one-row kernel holds a thread's x pairs for its whole slice of the row in
    registers: a slice above 16 * MAX_PERSISTENT_GROUPS inputs (or k_slices < 1) is refused by name
    before any launch; the dispatch cuts such rows into the fewest slices that fit (8B down_proj,
    K 21504: 3)."""
    from hybrid_engine.quantization.nvfp4_fma_kernels import _fma_config, nvfp4_skinny_linear_fma
    from hybrid_engine.quantization.nvfp4_persistent import MAX_PERSISTENT_GROUPS
    K = 16 * MAX_PERSISTENT_GROUPS + 16
    p, bs, gs = quantize_nvfp4(torch.randn(4, K))
    for k_slices in (1, 0):
        with pytest.raises(ValueError, match=rf"takes K / k_slices <= {K - 16} \(k_slices >= 1\), got K {K}, "
                                             rf"k_slices {k_slices}"):
            nvfp4_skinny_linear_fma(torch.randn(1, K), p, bs, gs, block_g=None, k_slices=k_slices)
    for k, slices in ((K - 16, 1), (K, 2), (21504, 3), (3 * (K - 16), 3), (3 * (K - 16) + 16, 4)):
        config = _fma_config(4096, k)
        assert config["block_g"] is None and config.get("k_slices", 1) == slices, (k, config)


def test_nvfp4_dot_kernel_refuses_bfloat16_off_cuda():
    """Off CUDA the dot kernel runs Triton's interpreter, whose bfloat16 tl.dot is not exact: a
    bfloat16 x is refused by name (nvfp4_linear, the public op, dequantizes on CPU instead)."""
    from hybrid_engine.quantization.nvfp4 import nvfp4_linear, nvfp4_linear_ref
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear_dot
    p, bs, gs = quantize_nvfp4(torch.randn(8, 32))
    x = torch.randn(3, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16 x needs CUDA"):
        nvfp4_skinny_linear_dot(x, p, bs, gs)
    assert torch.equal(nvfp4_linear(x, p, bs, gs), nvfp4_linear_ref(x, p, bs, gs))


def test_nvfp4_dot_kernel_refuses_the_tiles_it_cannot_run():
    """Tiles that are not whole groups, 2-word tiles with x on the MMA's M side (wrong sums on sm_90,
    Triton 3.6) and k_slices < 1 are refused by name before any launch (the swapped form's 2-word
    tiles run: interpreter case nvfp4_dot_swap)."""
    from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear_dot
    p, bs, gs = quantize_nvfp4(torch.randn(8, 64))
    x = torch.randn(3, 64)
    for kw, msg in ((dict(block_w=3), "block_w must be a power of two >= 2"), (dict(block_w=1), "power of two >= 2"),
                    (dict(block_w=2), "block_w must be >= 4 with swap=False, got 2"),
                    (dict(block_w=4, k_slices=0), "k_slices must be >= 1, got 0")):
        with pytest.raises(ValueError, match=msg):
            nvfp4_skinny_linear_dot(x, p, bs, gs, **kw)


def test_fp8_dot_slices_rule_on_the_8b_shapes():
    """The 2-8-row FP8 dispatch cuts K in slices for the narrow long-row projections only (the H200
    sweep of 2026-11-28): out, down, q/o in 3, k/v in 4; in_proj, up_proj, lm_head and short rows
    (K < 4096, the Nano widths) whole."""
    from hybrid_engine.quantization.fp8_kernels import _dot_slices
    got = {name: _dot_slices(N, K) for name, N, K in [
        ("in_proj", 18560, 4096), ("out_proj", 4096, 8192), ("up_proj", 21504, 4096), ("down_proj", 4096, 21504),
        ("q/o_proj", 4096, 4096), ("k/v_proj", 1024, 4096), ("lm_head", 131072, 4096), ("nano q_proj", 4096, 2688)]}
    assert got == {"in_proj": 1, "out_proj": 3, "up_proj": 1, "down_proj": 3, "q/o_proj": 3, "k/v_proj": 4,
                   "lm_head": 1, "nano q_proj": 1}
