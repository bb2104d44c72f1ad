"""The FP8 outputs of the norm kernels sum each row (group) in the same order as the plain kernels,
so their codes are those of the plain output quantized (the fusion changes no logits). The order of
a ``tl.sum`` follows the layout Triton gives its operand, and Triton vectorises the memory ops of
one shape alike: a uint8 store of codes asks for 16 elements a thread where bfloat16 loads ask for
8. Compiled here for sm_90 (no GPU needed), the layouts of every float32 sum must be the plain
kernel's at each launch shape the engine uses: the block RMSNorm (``rmsnorm.fp8_out_supported``
widths; wider rows are not fused) and the Mamba gated norm (``triton_norm._launch_shape``)."""
import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybrid_engine.mamba_cache.ops.triton_common import next_pow2  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_norm import _gated_rmsnorm_kernel, _launch_shape  # noqa: E402
from hybrid_engine.models.rmsnorm import FP8_OUT_MAX_BLOCK, _rmsnorm_kernel, fp8_out_supported  # noqa: E402

BF = "*bf16"


def _sum_layouts(kernel, sig, consts, aligned, num_warps) -> list[tuple[str, str]]:
    """[(operand shape, layout)] of every float32 sum (a tt.reduce combining with addf)."""
    full = {n: sig.get(n, "constexpr") for n in kernel.arg_names if n in sig or n in consts}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in aligned and n in sig}
    ttgir = triton.compile(ASTSource(kernel, full, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=num_warps)).asm["ttgir"]
    layouts = dict(re.findall(r"#(\w+) = (#ttg\.\w+<[^\n]*>)", ttgir))
    out = []
    for m in re.finditer(r'"tt.reduce"\(%[\w#]+\) <\{axis = \d : i32\}> \(\{(.*?)\}\) : \((tensor<[^)]*>)\)',
                         ttgir, re.S):
        if "arith.addf" in m.group(1):
            operand = m.group(2)
            out.append((operand.split(",")[0], layouts[re.search(r"#(\w+)>", operand).group(1)]))
    return out


@pytest.mark.parametrize("d", [64, 256, 1024, 2688, 4096])
@pytest.mark.parametrize("add", [True, False], ids=["add", "first"])
def test_rmsnorm_fp8_sums_like_the_plain_kernel(d, add):
    assert fp8_out_supported(d)
    block = next_pow2(d)
    layouts = []
    for fp8 in (False, True):
        sig = dict(x_ptr=BF, r_ptr=BF, r_out_ptr=BF, w_ptr=BF, out_ptr="*u8" if fp8 else BF, s_ptr="*fp32" if fp8 else BF,
                   D="i32", eps="fp32", sx="i32", sr="i32", sro="i32", so="i32")
        layouts.append(_sum_layouts(_rmsnorm_kernel, sig, dict(ADD_RESIDUAL=add, BLOCK_D=block, FP8_OUT=fp8,
                                                               HW_ROUND=True, PDL=False),
                                    {"x_ptr", "r_ptr", "r_out_ptr", "w_ptr", "out_ptr", "D", "sx", "sr", "sro", "so"},
                                    min(16, max(1, block // 256))))
    assert len(layouts[0]) == 1 and layouts[0] == layouts[1], layouts


def test_wider_rows_are_not_fused():
    """8192-wide rows: the FP8 kernel's sum takes another layout, so the block norm keeps the
    16-bit path (``RMSNorm.add_norm_for`` checks ``fp8_out_supported``)."""
    assert not fp8_out_supported(FP8_OUT_MAX_BLOCK + 1) and not fp8_out_supported(8192)


@pytest.mark.parametrize("gs,groups", [(16, 64), (32, 4), (64, 8), (128, 8), (256, 16), (512, 2), (1024, 8),
                                       (2048, 1), (4096, 2)])
@pytest.mark.parametrize("T", [300, 8192], ids=["token_per_program", "token_blocks"])
def test_gated_norm_fp8_sums_like_the_plain_kernel(gs, groups, T):
    """At the launch shapes of ``triton_gated_rmsnorm``, with 16-byte aligned rows and unit column
    strides (what ``RMSNormWeight.for_projection`` admits)."""
    block_t, num_warps = _launch_shape(T, gs)
    layouts = []
    for fp8 in (False, True):
        sig = dict(y_ptr=BF, z_ptr=BF, w_ptr=BF, out_ptr="*u8" if fp8 else BF, s_ptr="*fp32" if fp8 else BF,
                   T="i32", gs="i32", G="i32", eps="fp32", sy_t="i32", sz_t="i32", so_t="i32")
        consts = dict(BLOCK_T=block_t, BLOCK_G=next_pow2(gs), LD_EV="", ST_CM="", MODE=0, FP8_OUT=fp8,
                      HW_ROUND=True, G_PAD=next_pow2(groups), sy_c=1, sz_c=1, so_c=1)     # unit column strides, as launched
        sums = _sum_layouts(_gated_rmsnorm_kernel, sig, consts,
                            {"y_ptr", "z_ptr", "w_ptr", "out_ptr", "gs", "sy_t", "sz_t", "so_t"}, num_warps)
        layouts.append({lay for shape, lay in sums if shape == f"tensor<{block_t}x{next_pow2(gs)}xf32"})
    assert len(layouts[0]) == 1 and layouts[0] == layouts[1], layouts
