"""Quantized-weight kernels and engine paths on CUDA (FP8-capable GPU: Ada / Hopper).

FP8 kernels vs their exact float32 twins (tests/quant/quant_checks.py, expert_checks.py: poisoned
outputs, ragged rows, odd widths) in bf16 and fp16, the decode kernels in float32 too; the W8A8
prefill path (``torch._scaled_mm``) vs ``fp8_scaled_mm_ref``; the public dispatch picks the
kernels; and the engine: an FP8 / NVFP4 model generates the same greedy tokens with CUDA graphs
and async scheduling as eagerly. The NVFP4 kernels: test_nvfp4_kernels_cuda.py."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "quant"))
import expert_checks as ec  # noqa: E402
import quant_checks as qc  # noqa: E402
from hybrid_engine.quantization.fp8 import (fp8_linear, fp8_scaled_mm, fp8_scaled_mm_ref,  # noqa: E402
                                            quantize_fp8)
from hybrid_engine.quantization.fp8_kernels import fp8_skinny_linear, fp8_skinny_linear_dot  # noqa: E402
from hybrid_engine.quantization.nvfp4 import nvfp4_linear  # noqa: E402
from hybrid_engine.quantization.nvfp4_kernels import nvfp4_skinny_linear  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
# one row covers every config of fp8_kernels._fma_config: (8, 2048, 8) long rows, (4, 2048, 4) wide
# N, (4, 1024, 4) K = 2688, (2, 2048, 4) short rows, (2, 4096, 8) small weights (K 2688 < the tile)
SHAPES = [(1, 4096, 4096), (1, 17504, 4096), (1, 4096, 8192), (1, 4096, 2688), (1, 2688, 4096), (1, 256, 2688),
          (2, 37, 130), (4, 4096, 4096), (8, 21504, 4096), (8, 131072 // 16, 4096), (3, 1, 17)]


@pytest.fixture(autouse=True)
def _fp8_gpu(monkeypatch):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs an FP8-capable GPU")


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_fp8_skinny_kernel(shape, per_channel, dtype):
    m, n, k = shape
    qc.check_fp8(fp8_skinny_linear, DEV, dtype, m, n, k, per_channel, seed=m + n)


@pytest.mark.parametrize("dtype", [BF16, F16, F32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("kernel", ["fma", "dot"])
def test_fp8_every_code(kernel, dtype):
    """Every finite e4m3 code (subnormals included) through the one-row FMA kernel and the 2-8-row
    dot kernel, each product exact."""
    from hybrid_engine.quantization.fp8_kernels import fp8_skinny_linear_fma
    impl = fp8_skinny_linear_fma if kernel == "fma" else fp8_skinny_linear_dot
    xs = (1.0, 2.0 ** -13, 2.0 ** 5) if dtype == F16 else (1.0, 2.0 ** -60, 2.0 ** 60)
    qc.check_fp8_every_code(impl, DEV, dtype, xs)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape,k_slices,per_channel", [((8, 4096, 21504), 6, True), ((8, 4096, 8192), 4, False),
                                                        ((3, 1000, 2688), 3, True), ((5, 33, 272), 2, False)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_fp8_dot_kernel_k_slices(shape, k_slices, per_channel, dtype):
    """The FP8 dot kernel with K in slices (float32 partial sums added in slice order with the
    bias; a last slice shorter than the others) against the float32 twin."""
    m, n, k = shape
    qc.check_fp8(lambda *a: fp8_skinny_linear_dot(*a, block_n=32, block_k=512, k_slices=k_slices), DEV, dtype,
                 m, n, k, per_channel, seed=m + n)


# one row: the long-row (8, 2048, 8), wide-N (4, 2048, 4), narrow-K (4, 1024, 4), short-row (2, 2048, 4)
# and small-weight (2, 4096, 8) configs
RELU2_SHAPES = [(1, 4096, 21504), (1, 5000, 4096), (1, 3712, 2688), (1, 2688, 3712), (1, 37, 130), (2, 4096, 21504),
                (8, 4096, 21504), (3, 1, 17)]


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("shape", RELU2_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in RELU2_SHAPES])
def test_fp8_skinny_relu2_on_load(shape, dtype):
    """The relu² MLP's FP8 down_proj at decode: the one-row kernel applies relu² as it loads x (with
    the first weight tile loaded before the PDL wait), 2+ rows run the relu² kernel before the dot
    kernel; bit for bit the projection of relu2_ref(x)."""
    m, n, k = shape
    qc.check_fp8_relu2(fp8_skinny_linear, DEV, dtype, m, n, k, per_channel=m != 2, seed=m + n)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("T,grouped", [(1, False), (8, False), (8, True), (200, True)])
def test_fp8_experts(T, grouped, dtype):
    # Nano-30B-A3B-like widths (reduced expert count): D 2688, F 1856, 16 experts, top 6
    ec.check_fp8_experts(DEV, dtype, T, 16, 6, 2688, 1856, grouped, seed=T)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("T,E,k,kind", [(9, 16, 6, "ragged"), (200, 16, 6, "ragged"), (64, 16, 6, "one_expert"),
                                        (1100, 128, 6, "ragged"), (300, 512, 22, "ragged"), (40, 16, 2, "swiglu")])
def test_fp8_experts_w8a8(T, E, k, kind, dtype):
    """The W8A8 grouped path on the FP8 tensor cores against its twin (same codes, float32 sums):
    Nano-30B-A3B widths (D 2688, F 1856) with 16 experts; 128 experts top-6 at 1100 tokens and 512
    top-22 (Super's counts) at narrower widths (the float32 weights are made on the host); every
    token on one expert; SwiGLU experts."""
    D, F = (2688, 1856) if E <= 16 and kind != "swiglu" else (1024, 512)
    ec.check_fp8_experts_w8a8(DEV, dtype, T, E, k, D, F, seed=T, swiglu=kind == "swiglu",
                              one_expert=kind == "one_expert")


def test_quantize_rows_bounded_kernel():
    qc.check_quantize_rows_bounded(DEV)


def test_quantize_rows_kernel():
    """The prefill activation quantizer on CUDA: code for code equal to the torch twin (poisoned
    outputs, every e4m3 value and midpoint, odd widths, 1e-3..1e3 rows, a zero row)."""
    from hybrid_engine.quantization.fp8_quantizer import quantize_rows_fp8
    shapes = ((1, 5), (3, 130), (7, 1100), (300, 4096), (5, 21504))
    for block_k in (8192, 1024):                     # one pass (K <= block_k) and two
        for relu2 in (False, True):                  # relu² applied as the row is read (the MLP's down_proj)
            assert qc.check_quantize_rows(quantize_rows_fp8, DEV, shapes=shapes, block_k=block_k, relu2=relu2) > 0


@pytest.mark.parametrize("T,D,residual", [(300, 4096, True), (7, 4096, True), (1000, 2688, True), (33, 4096, False)])
def test_add_rmsnorm_fp8_equals_norm_then_quantizer(T, D, residual):
    """The block norm with the W8A8 quantizer in its epilogue: the same codes, scales and residual
    as the Triton norm followed by ``quantize_rows_fp8``, and near the torch twin."""
    assert qc.check_add_rmsnorm_fp8(DEV, BF16, T, D, seed=T, residual=residual) == T * D


def test_fp8_norm_fusion_keeps_the_logits(model_dirs, monkeypatch):
    """An FP8 model whose block norms hand quantized rows to in_proj / up_proj / q, k, v
    (``RMSNorm.add_norm_for``) gives the same greedy tokens and logprobs, bit for bit, as with the
    fusion off (a forward pre-hook on every FP8 projection turns it off: hooks must see 16-bit
    inputs). Chunked prompts longer than the 8 rows of the skinny path take the W8A8 path."""
    import hybrid_engine.models.layers as layers
    from hybrid_engine import LLM, SamplingParams
    from hybrid_engine.quantization.linear import Fp8Linear
    fused_calls = []
    real = layers.add_rmsnorm_fp8
    monkeypatch.setattr(layers, "add_rmsnorm_fp8", lambda *a: fused_calls.append(1) or real(*a))
    d = model_dirs("quant_cuda_norm", pattern="M-M*-M-", seed=4, hidden_size=256, intermediate_size=512,
                   mamba_num_heads=16, mamba_head_dim=16)          # every projection width a multiple of 16
    prompts = [list(range(3, 3 + n)) for n in (70, 9, 130)]
    sp = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)
    # prefix caching off: the second run would otherwise hit the cache, computing fewer rows a step,
    # and a step of at most 8 rows takes the weight-only skinny path (other numbers than W8A8)
    llm = LLM(d, dtype="bfloat16", device=DEV, quantization="fp8", enforce_eager=True, max_num_seqs=4,
              max_num_batched_tokens=64, enable_prefix_caching=False)
    def run():
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    fused = run()
    assert len(fused_calls) > 0
    projections = [m for m in llm.engine.runner.model.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) >= 10
    for m in projections:
        m.register_forward_pre_hook(lambda mod, args: None)
    fused_calls.clear()
    plain = run()
    assert not fused_calls
    assert fused == plain


@pytest.mark.parametrize("rows", [4, 40])
def test_fp8_linear_relu2_equals_relu2_then_linear(rows):
    """``fp8_linear(..., relu2=True)`` (the quantizer applies relu² on the W8A8 path; the skinny
    path runs the relu² kernel first) equals the projection of ``relu2(x)``, bit for bit."""
    from hybrid_engine.models.activation import relu2
    from hybrid_engine.quantization.fp8 import fp8_linear, quantize_fp8
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 1856, generator=g)).to(BF16).to(DEV)
    w_q, s = quantize_fp8(torch.randn(2688, 1856, generator=g), True)
    w_q, s = w_q.to(DEV), s.to(DEV)
    assert torch.equal(fp8_linear(x, w_q, s, relu2=True), fp8_linear(relu2(x), w_q, s))


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
def test_scaled_mm_prefill_path(per_channel, static):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(300, 1024, generator=g) * 2).to(BF16).to(DEV)
    w_q, s = (t.to(DEV) for t in quantize_fp8(torch.randn(768, 1024, generator=g), per_channel))
    in_scale = (x.float().abs().amax() / 448).reshape(()) if static else None
    y = fp8_scaled_mm(x, w_q, s, in_scale)
    ref = fp8_scaled_mm_ref(x, w_q, s, in_scale)
    err = float((y.float() - ref.float()).norm() / ref.float().norm())
    assert err < 1e-2, err
    y2 = fp8_linear(x, w_q, s, in_scale)          # the dispatch takes the same path for 300 rows
    assert torch.equal(y2, y)


def test_decode_dispatch_uses_the_kernels():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 256, generator=g).to(BF16).to(DEV)
    w_q, s = (t.to(DEV) for t in quantize_fp8(torch.randn(512, 256, generator=g), True))
    assert torch.equal(fp8_linear(x, w_q, s), fp8_skinny_linear(x, w_q, s))
    from hybrid_engine.quantization.nvfp4 import quantize_nvfp4
    p, bs, gs = (t.to(DEV) for t in quantize_nvfp4(torch.randn(512, 256, generator=g)))
    assert torch.equal(nvfp4_linear(x, p, bs, gs), nvfp4_skinny_linear(x, p, bs, gs))


@pytest.mark.parametrize("dtype", [BF16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_quantized_shared_expert_on_decode_batches(method, dtype):
    """The MoE's shared expert with quantized projections, on decode-sized batches (where the
    plain model takes two fused row-wise kernels) equals the MLP on the dequantized weights. The
    fused kernels once read the FP8 codes as values, unscaled: an FP8 MoE model's tokens then
    changed with how many tokens shared a step (seen as chunked prefill != unchunked on CUDA)."""
    from hybrid_engine.models.layers import MLP
    from hybrid_engine.models.moe_ops import shared_expert
    from hybrid_engine.quantization.fp8 import dequantize_fp8
    from hybrid_engine.quantization.linear import Fp8Linear, Nvfp4Linear
    from hybrid_engine.quantization.nvfp4 import dequantize_nvfp4
    g = torch.Generator().manual_seed(3)
    mlp = MLP(256, 384)
    with torch.no_grad():
        for lin in (mlp.up_proj, mlp.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / lin.in_features ** 0.5)
    mlp = mlp.to(DEV, dtype)
    quant = Fp8Linear if method == "fp8" else Nvfp4Linear
    mlp.up_proj, mlp.down_proj = quant.quantized_from(mlp.up_proj), quant.quantized_from(mlp.down_proj)
    if method == "fp8":
        deq = [dequantize_fp8(m.weight, m.weight_scale) for m in (mlp.up_proj, mlp.down_proj)]
    else:
        deq = [dequantize_nvfp4(m.weight, m.weight_scale, m.weight_scale_2) for m in (mlp.up_proj, mlp.down_proj)]
    for T in (1, 3, 8):
        x = torch.randn(T, 256, generator=g).to(DEV, dtype)
        got = shared_expert(x, mlp).float()
        want = torch.nn.functional.linear(torch.relu(x.float() @ deq[0].T).square(), deq[1])
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        err = (got - want).abs().max().item()
        assert err <= tol * want.abs().max().item(), (T, err)


@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_engine_graphs_equal_eager(model_dirs, method):
    from hybrid_engine import LLM, SamplingParams
    d = model_dirs("quant_cuda", pattern="M-M*-ME", seed=2, hidden_size=128, intermediate_size=256,
                   mamba_num_heads=8, mamba_head_dim=16, moe_intermediate_size=128,
                   moe_shared_expert_intermediate_size=128)
    prompts = [list(range(3, 3 + n)) for n in (5, 33, 17, 2)]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = []
    for eager in (True, False):
        llm = LLM(d, dtype="bfloat16", device=DEV, quantization=method, enforce_eager=eager, max_num_seqs=4,
                  max_num_batched_tokens=32, async_scheduling=not eager)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
        del llm
    assert outs[0] == outs[1]


@pytest.mark.parametrize("relu2", [False, True], ids=["plain", "relu2"])
@pytest.mark.parametrize("shape", [(8, 4096, 4096), (4, 1024, 2048), (8, 18560, 4096), (3, 4096, 21504), (2, 256, 2688)],
                         ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_fp8_float32_rows_keep_one_row_bits(shape, relu2):
    """float32 rows of 2-8 (a float32 FP8 model's verify step, an FP8 drafter of a float32 engine)
    run the one-row kernel a grid row each: every row equals, bit for bit, the same row alone, so a
    verify step's projections are a one-token step's (docs/design.md invariant 2)."""
    m, n, k = shape
    qc.check_fp8_rows_invariant(fp8_skinny_linear, DEV, m, n, k, per_channel=m % 2 == 0, relu2=relu2, seed=m + n)
