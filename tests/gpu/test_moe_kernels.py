"""MoE kernels (hybrid_engine/models/triton_moe.py) against their torch twins (moe_ops): the
router, the sort/align step, the decode (per-pair GEMV) and grouped-GEMM expert paths.

- CPU, not marked gpu: the alignment invariants (torch ops) and tiny cases in the Triton
  interpreter (moe_interpret_cases.py, one subprocess, a few seconds);
- gpu: a small representative set; ``slow``: the sweep (1..8 and 1000+ tokens, 128 and 512
  experts, top-6 and top-22, latent and hidden widths, ragged / zero / single-expert loads,
  bfloat16 / float16 / float32).
"""
import re
import sys
from pathlib import Path

import pytest
import torch

import moe_cases as mc

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases  # noqa: E402

INTERPRET_CASES = ["moe_router_logits_f16", "moe_router_logits_bf16", "moe_shared_up_relu2", "moe_align", "moe_align_one", "moe_align_chunked", "moe_align_chunked_one", "moe_align_chunked_512", "moe_block", "moe_block_latent", "moe_route", "moe_route_groups", "moe_route_no_renorm", "moe_decode", "moe_decode_add_f16",
                   "moe_grouped_ragged", "moe_grouped_one_expert_add", "moe_grouped_latent_shape",
                   "moe_route_softmax", "moe_decode_swiglu", "moe_decode_swiglu_add_f16", "moe_grouped_swiglu_ragged",
                   "moe_block_granite"]


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases(HERE / "moe_interpret_cases.py")


@pytest.mark.parametrize("name", INTERPRET_CASES)
def test_moe_kernel_in_interpreter(interpreter_results, name):
    assert_case(interpreter_results, name)


def test_launched_kernels_compile_for_sm90(interpreter_results):
    """The kernels as the cases launched them also compile for the GPU (the interpreter skips
    the compiler's checks)."""
    assert_compiles_for_sm90(interpreter_results)


def test_router_logits_kernel_compiles_to_bf16_mma(interpreter_results):
    """The router's logits kernel as the interpreter case launched it, and at the rule's two tiles,
    with the bf16 tensor-core dots the GPU takes (the interpreter takes float32 dots): it compiles
    for sm_90 and its PTX holds bf16 MMAs."""
    from triton_interpret import compile_launch_for_sm90
    recs = [r for r in interpreter_results["_launches"] if r.get("name") == "_router_logits_kernel"]
    assert recs, "the interpreter case launched no _router_logits_kernel"
    from hybrid_engine.models.triton_moe_route import router_tiles
    for T, E in ((37, 20), (2048, 128), (8192, 128)):           # the case's tiles, then both of the rule's
        bm, bn, bk, warps = router_tiles(T, E) if T > 37 else (None,) * 4
        consts = dict(recs[0]["constexprs"], F32_DOTS=False)
        options = dict(recs[0]["options"])
        if bm is not None:
            consts.update(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
            options.update(num_warps=warps)
        ptx = compile_launch_for_sm90(dict(recs[0], constexprs=consts, options=options)).asm["ptx"]
        assert re.search(r"(wgmma|mma\.sync)\S*\.bf16", ptx), f"no bf16 MMA in the router kernel's PTX ({consts})"


@pytest.mark.parametrize("T,E,k,bm,load", [(1, 128, 6, 16, "uniform"), (37, 128, 6, 16, "ragged"),
                                           (300, 16, 4, 64, "one"), (50, 512, 22, 16, "few"),
                                           (5, 8, 1, 32, "one")])
def test_alignment_groups_pairs_by_expert(T, E, k, bm, load):
    mc.check_align("cpu", T, E, k, bm, load)


def test_cpu_route_and_experts_use_the_references():
    from hybrid_engine.models import moe_ops
    mc.check_experts(lambda h, u, d, i, w, a, out: out.copy_(moe_ops.routed_experts(h, u, d, i, w, a)),
                     "cpu", torch.float32, 9, 16, 4, 24, 20, load="ragged", add=True)


# ------------------------------------------------------------------------------------------ GPU

def _poison_cuda():
    """Leave NaN bytes in the caching allocator's free blocks, so unwritten buffers show up."""
    x = torch.full((64 << 20,), float("nan"), device="cuda")
    del x


def _grouped(*a, **kw):
    from hybrid_engine.models.triton_moe import routed_experts_triton
    return routed_experts_triton(*a, force_grouped=True, **kw)


def _auto(*a, **kw):
    from hybrid_engine.models.triton_moe import routed_experts_triton
    return routed_experts_triton(*a, **kw)


# (T, E, k, D, F, D_out, load, add): Nano-like (hidden 2688 -> 1856), Super-like latent
# (latent 1024 -> 2688) shapes shrunk only where the sweep would be slow
FAST = [(1, 128, 6, 512, 256, None, "uniform", True), (8, 128, 6, 512, 256, None, "ragged", False),
        (33, 128, 6, 256, 128, None, "ragged", True), (1024, 128, 6, 256, 128, None, "ragged", False),
        (4, 512, 22, 256, 384, None, "uniform", False), (300, 512, 22, 128, 256, None, "one", False),
        (2800, 128, 6, 256, 128, None, "ragged", True)]          # 131 pairs per expert: 128-row tiles
SWEEP = [(T, E, k, D, F, None, load, add)
         for T in (1, 2, 5, 8, 31, 1200) for (E, k, D, F) in ((128, 6, 2688, 1856), (512, 22, 1024, 2688))
         for load in ("uniform", "ragged", "few", "one") for add in (False, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", FAST)
def test_experts_cuda(case, dtype):
    T, E, k, D, F, D_out, load, add = case
    _poison_cuda()
    mc.check_experts(_auto, "cuda", dtype, T, E, k, D, F, D_out, load=load, add=add)
    if T <= 8:                                  # the grouped path on decode sizes too
        mc.check_experts(_grouped, "cuda", dtype, T, E, k, D, F, D_out, load=load, add=add, seed=1)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", SWEEP)
def test_experts_cuda_sweep(case, dtype):
    T, E, k, D, F, D_out, load, add = case
    _poison_cuda()
    mc.check_experts(_auto, "cuda", dtype, T, E, k, D, F, D_out, load=load, add=add, seed=T)
    mc.check_experts(_grouped, "cuda", dtype, T, E, k, D, F, D_out, load=load, add=add, seed=T + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", [(1, 64, 8, 512, 256, None, "uniform", True), (8, 64, 8, 512, 256, None, "ragged", True),
                                  (700, 64, 8, 256, 128, None, "ragged", False)])
def test_experts_swiglu_cuda(case, dtype):
    """Granite-4.0-H's experts (SwiGLU, up [E, 2F, D]): decode GEMV and grouped GEMM paths."""
    T, E, k, D, F, D_out, load, add = case
    _poison_cuda()
    mc.check_experts(_auto, "cuda", dtype, T, E, k, D, F, D_out, load=load, add=add, activation="swiglu")
    if T <= 8:
        mc.check_experts(_grouped, "cuda", dtype, T, E, k, D, F, D_out, load=load, add=add, seed=1,
                         activation="swiglu")


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(1, 64, 8), (8, 62, 6), (1500, 64, 8)])
def test_route_softmax_cuda(T, E, k):
    from hybrid_engine.models.triton_moe_route import route_triton
    _poison_cuda()
    mc.check_route(route_triton, "cuda", T, E, k, scale=1.0, scoring="softmax")


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,n_group,topk_group", [(1, 128, 6, 1, 1), (8, 128, 6, 1, 1), (1500, 128, 6, 1, 1),
                                                      (3, 512, 22, 1, 1), (1200, 512, 22, 1, 1),
                                                      (64, 256, 8, 8, 4)])
def test_route_cuda(T, E, k, n_group, topk_group):
    from hybrid_engine.models.triton_moe_route import route_triton
    _poison_cuda()
    mc.check_route(route_triton, "cuda", T, E, k, n_group, topk_group)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,D", [(9, 128, 2688), (2048, 128, 2688), (300, 512, 4096), (77, 20, 80)])
def test_router_logits_kernel_cuda(T, E, D):
    """The prefill router's logits on the bf16 tensor cores (weight in three bf16 parts): float32
    accuracy at the Nano (128 x 2688) and Super (512 x 4096) router widths, and at a narrow width
    where two parts alone would fail (``check_router_logits``)."""
    mc.check_router_logits("cuda", T, E, D, seed=T, tell_parts=D <= 256)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T", [1, 3, 8])
def test_rowwise_linear_cuda(T, dtype):
    from hybrid_engine.models.triton_moe import rowwise_linear_triton
    mc.check_rowwise(rowwise_linear_triton, "cuda", dtype, T, 128, 2688, w_dtype=torch.float32,
                     out_dtype=torch.float32)                                   # router logits
    mc.check_rowwise(rowwise_linear_triton, "cuda", dtype, T, 3712, 2688, relu2=True, seed=1)   # shared up
    mc.check_rowwise(rowwise_linear_triton, "cuda", dtype, T, 2688, 3712, seed=2)               # shared down


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,bm", [(1, 128, 6, 16), (2048, 128, 6, 64), (128, 512, 22, 16)])
def test_alignment_cuda(T, E, k, bm):
    mc.check_align("cuda", T, E, k, bm, "ragged")


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,bm,load", [(1, 128, 6, 16, "uniform"), (32, 128, 6, 16, "ragged"),
                                           (128, 128, 6, 16, "one"), (170, 128, 6, 16, "few"),
                                           (11, 512, 22, 16, "ragged"), (40, 16, 4, 64, "uniform")])
def test_alignment_kernel_cuda(T, E, k, bm, load):
    from hybrid_engine.models.moe_align import align_pairs_triton
    _poison_cuda()
    mc.check_align("cuda", T, E, k, bm, load, align_fn=align_pairs_triton)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("add", [False, True], ids=["routed", "with_add"])
def test_combine_rounds_each_product_like_the_reference(dtype, add):
    """combine_pairs bit for bit against float32 torch ops in the reference's order: each pair's
    output times its weight rounded, then added (a fused multiply-add would differ in last bits)."""
    from hybrid_engine.models.triton_moe import combine_pairs
    g = torch.Generator(device="cuda").manual_seed(3)
    T, k, D = 300, 6, 2688
    pair = torch.randn(T * k, D, device="cuda", generator=g).to(dtype)
    w = torch.rand(T, k, device="cuda", generator=g) * 2.5
    shared = torch.randn(T, D, device="cuda", generator=g).to(dtype) if add else None
    acc = pair[0::k].float() * w[:, :1]
    for j in range(1, k):
        acc = acc + pair[j::k].float() * w[:, j:j + 1]
    want = acc.to(dtype)
    if add:
        want = (want.float() + shared.float()).to(dtype)
    _poison_cuda()
    out = torch.full((T, D), float("nan"), dtype=dtype, device="cuda")
    got = combine_pairs(pair, w, dtype, shared, out)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k,bm,load", [(2048, 128, 6, 128, "ragged"), (8192, 128, 6, 128, "few"),
                                           (2048, 512, 22, 64, "one"), (3, 128, 6, 16, "uniform")])
def test_alignment_chunked_cuda(T, E, k, bm, load):
    """The prefill alignment (three launches) equals the torch ops' on prefill-sized batches."""
    from hybrid_engine.models.moe_align import align_pairs_chunked
    _poison_cuda()
    mc.check_align("cuda", T, E, k, bm, load, align_fn=align_pairs_chunked)


@pytest.mark.gpu
def test_moe_step_is_graph_capturable():
    """Route + experts inside a CUDA graph: replays with new inputs give the eager result."""
    from hybrid_engine.models.moe_ops import RouteSpec, route, routed_experts
    torch.manual_seed(0)
    T, E, k, D, F = 8, 128, 6, 256, 128
    spec = RouteSpec(num_experts=E, top_k=k, scale=2.5)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(E, D, device="cuda") / D ** 0.5
    bias = torch.zeros(E, device="cuda")
    up = torch.randn(E, F, D, device="cuda", dtype=torch.bfloat16) / D ** 0.5
    down = torch.randn(E, D, F, device="cuda", dtype=torch.bfloat16) / F ** 0.5
    counts = torch.zeros(E, dtype=torch.int32, device="cuda")

    def step():
        ids, w = route(torch.nn.functional.linear(x.float(), gate), bias, spec, counts)
        return routed_experts(x, up, down, ids, w)
    for T_ in (T, 64):                     # both paths: decode (T <= 8) and grouped
        x = torch.randn(T_, D, device="cuda", dtype=torch.bfloat16)
        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = step()
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            counts.zero_()
            g.replay()
            torch.cuda.synchronize()
            ref = step()
            torch.testing.assert_close(y, ref, atol=0, rtol=0)
            assert int(counts.sum()) == 2 * T_ * k         # replay + eager both counted
