"""The FP8 output of the block norm kernel sums each row in the same order as the plain kernel,
so their codes are those of the plain output quantized (the fusion changes no logits). The order of
a ``tl.sum`` follows the layout Triton gives its operand, and Triton vectorises the memory ops of
one shape alike: a uint8 store of codes asks for 16 elements a thread where bfloat16 loads ask for
8. Compiled here for sm_90 (no GPU needed), the layouts of every float32 sum must be the plain
kernel's at each width the block RMSNorm fuses (``rmsnorm.fp8_out_supported``; wider rows are not
fused)."""
import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybrid_engine.mamba_cache.ops.triton_common import next_pow2  # noqa: E402
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
