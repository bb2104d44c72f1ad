"""Programmatic dependent launch must not change how a kernel reads memory: each PDL kernel is
compiled for sm_90 (no GPU needed) with and without PDL, and its PTX must have the same global
loads, vector loads and async copies. (Ten of the twelve kernels that take the flag; not yet
the state update and the conv update.) Adding the wait's zero to a pointer without keeping its
alignment (``x_ptr += z`` instead of ``z * 16``) turned the one-row FP8 projection's vector loads
of x into scalar ones and its b=1 decode went from 1.56x to 1.30x bf16 (H100); this catches it."""
import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybrid_engine.attention.triton_attention import _combine_splits_kernel, _paged_attn_kernel  # noqa: E402
from hybrid_engine.models.rmsnorm import _rmsnorm_kernel  # noqa: E402
from hybrid_engine.models.skinny_linear import _linear_dot_kernel, _linear_fma_kernel  # noqa: E402
from hybrid_engine.models.triton_moe import _combine_kernel, _pair_gemv_kernel  # noqa: E402
from hybrid_engine.models.triton_moe_route import _route_kernel  # noqa: E402
from hybrid_engine.quantization.fp8_kernels import _fp8_dot_kernel, _fp8_fma_kernel  # noqa: E402

BF, F8 = "*bf16", "*fp8e4nv"
# (kernel, signature of its runtime arguments, constexprs, arguments specialised as multiples of 16)
_COMBINE_SIG = dict(qsl_ptr="*i32", sl_ptr="*i32", o_ptr=BF, po_ptr="*fp32", pm_ptr="*fp32", pl_ptr="*fp32",
                    n_splits="i32", T="i32", nH="i32", hd="i32", so_t="i32", so_h="i32", so_d="i32")

CASES = {
    "linear_fma": (_linear_fma_kernel, dict(x_ptr=BF, w_ptr=BF, b_ptr=BF, y_ptr=BF, M="i32", N="i32", K="i32",
                                            sxm="i32", swn="i32", sym="i32"),
                   dict(HAS_BIAS=False, M_ROWS=1, BLOCK_N=2, BLOCK_K=1024), dict(num_warps=4)),
    "linear_dot": (_linear_dot_kernel, dict(x_ptr=BF, w_ptr=BF, b_ptr=BF, y_ptr=BF, M="i32", N="i32", K="i32",
                                            sxm="i32", swn="i32", sym="i32"),
                   dict(HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128), dict(num_warps=4, num_stages=4)),
    "fp8_fma": (_fp8_fma_kernel, dict(x_ptr=BF, w_ptr=F8, s_ptr="*fp32", b_ptr="*fp32", y_ptr=BF, N="i32",
                                      K="i32", swn="i32", sxm="i32"),
                dict(PER_CHANNEL=True, HAS_BIAS=False, BLOCK_N=2, BLOCK_K=2048), dict(num_warps=4)),
    "fp8_dot": (_fp8_dot_kernel, dict(x_ptr=BF, w_ptr=F8, s_ptr="*fp32", b_ptr="*fp32", y_ptr=BF, part_ptr="*fp32",
                                      M="i32", N="i32", K="i32", K_S="i32", sxm="i32", swn="i32", sym="i32"),
                dict(PER_CHANNEL=True, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=512, SPLIT=False),
                dict(num_warps=4, num_stages=3)),
    # K in slices (the rule's form on the narrow long rows): float32 partials stored
    "fp8_dot_split": (_fp8_dot_kernel, dict(x_ptr=BF, w_ptr=F8, s_ptr="*fp32", b_ptr="*fp32", y_ptr=BF,
                                            part_ptr="*fp32", M="i32", N="i32", K="i32", K_S="i32", sxm="i32",
                                            swn="i32", sym="i32"),
                      dict(PER_CHANNEL=True, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=32, BLOCK_K=512, SPLIT=True),
                      dict(num_warps=4, num_stages=3)),
    "rmsnorm": (_rmsnorm_kernel, dict(x_ptr=BF, r_ptr=BF, r_out_ptr=BF, w_ptr=BF, out_ptr=BF, s_ptr=BF,
                                      D="i32", eps="fp32", sx="i32", sr="i32", sro="i32", so="i32"),
                dict(ADD_RESIDUAL=True, BLOCK_D=4096, FP8_OUT=False, HW_ROUND=True), dict(num_warps=16)),
    "rmsnorm_fp8": (_rmsnorm_kernel, dict(x_ptr=BF, r_ptr=BF, r_out_ptr=BF, w_ptr=BF, out_ptr="*u8", s_ptr="*fp32",
                                          D="i32", eps="fp32", sx="i32", sr="i32", sro="i32", so="i32"),
                    dict(ADD_RESIDUAL=True, BLOCK_D=4096, FP8_OUT=True, HW_ROUND=True), dict(num_warps=16)),
    "pair_gemv": (_pair_gemv_kernel, dict(a_ptr=BF, w_ptr=BF, ids_ptr="*i32", out_ptr=BF,
                                          N="i32", K="i32", A_DIV="i32", s_am="i32", s_we="i32", s_wn="i32",
                                          s_om="i32", ws_ptr="*fp32"),
                  dict(RELU2=False, BLOCK_N=4, BLOCK_K=256, ONE_WEIGHT=False, ROUND=True,
                       SWIGLU=False, W_SCALED=False), dict(num_warps=2)),
    "moe_combine": (_combine_kernel, dict(pair_ptr=BF, wt_ptr="*fp32", add_ptr=BF, out_ptr=BF, N="i32", TOP_K="i32"),
                    dict(HAS_ADD=True, BLOCK_N=256), dict(num_warps=4, enable_fp_fusion=False)),
    "moe_route": (_route_kernel, dict(logits_ptr="*fp32", bias_ptr="*fp32", ids_ptr="*i32", w_ptr="*fp32",
                                      cnt_ptr="*i32", valid_ptr="*i32", E="i32", s_l="i32", scale="fp32"),
                  dict(TOP_K=6, N_GROUP=1, PER_GROUP=128, TOPK_GROUP=1, RENORM=True, COUNT=True, HAS_VALID=True,
                       BLOCK_E=128, BLOCK_K=8, BLOCK_G=2, SOFTMAX=False), dict(num_warps=1)),
    "attention_split_combine": (_combine_splits_kernel, _COMBINE_SIG,
                                dict(BLOCK_Q=1, BLOCK_D=128, ROW_SPLIT=True, BLOCK_N=64, SPLITS_PAD=64),
                                dict(num_warps=4)),
    # prefill tiles' combine: one range per loop step
    "attention_split_combine_loop": (_combine_splits_kernel, _COMBINE_SIG,
                                     dict(BLOCK_Q=4, BLOCK_D=128, ROW_SPLIT=True, BLOCK_N=32, SPLITS_PAD=0),
                                     dict(num_warps=4)),
    "paged_attention_decode": (_paged_attn_kernel, dict(
        q_ptr=BF, k_ptr=BF, v_ptr=BF, qsl_ptr="*i32", sl_ptr="*i32", bt_ptr="*i32", o_ptr=BF, po_ptr="*fp32",
        pm_ptr="*fp32", pl_ptr="*fp32", ks_ptr="*fp32", vs_ptr="*fp32", qk_scale="fp32",
        **{n: "i32" for n in ("G", "hd", "bs", "split_len", "n_splits", "T", "nH", "sq_t", "sq_h", "sq_d",
                              "sk_b", "sk_o", "sk_h", "sk_d", "sv_b", "sv_o", "sv_h", "sv_d", "sbt_b", "sbt_m",
                              "so_t", "so_h", "so_d")}),
        dict(PREC="tf32", SPLIT=True, BLOCK_Q=1, G_PAD=16, BLOCK_N=64, BLOCK_D=128, KV_FP8=False,
             ROW_SPLIT=True),
        dict(num_warps=4)),
}
ALIGNED = {"x_ptr", "w_ptr", "y_ptr", "a_ptr", "out_ptr", "r_ptr", "r_out_ptr", "K", "K_S", "D", "sxm", "swn", "sym",
           "sx", "sr", "sro", "so", "s_am", "s_we", "s_wn", "s_om", "q_ptr", "k_ptr", "v_ptr", "o_ptr", "sq_t",
           "sk_b", "sk_o", "sv_b", "sv_o", "so_t", "hd"}


def _ptx(kernel, sig, consts, opts, pdl: bool, prefetch: bool = False) -> str:
    """The kernel's PTX for sm_90; the optional flags a kernel has (PREFETCH, RELU2, BF16_BITS, ROWS)
    take ``prefetch`` / their defaults unless ``consts`` sets them."""
    optional = {"PREFETCH": prefetch, "RELU2": False, "BF16_BITS": False, "ROWS": False}   # flags with defaults
    flags = {"PDL": pdl} | {k: v for k, v in optional.items() if k in kernel.arg_names and k not in consts}
    names = list(sig) + list(consts) + list(flags)
    full = {n: sig.get(n, "constexpr") for n in kernel.arg_names if n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in ALIGNED and n in sig}
    src = ASTSource(kernel, full, constexprs={**consts, **flags}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={**opts, "launch_pdl": pdl}).asm["ptx"]


def _memory_ops(kernel, sig, consts, opts, pdl: bool, prefetch: bool = False) -> dict:
    ptx = _ptx(kernel, sig, consts, opts, pdl, prefetch)
    ops = re.findall(r"\b(ld\.global[\w.]*|cp\.async\.[\w.]*|st\.global[\w.]*)", ptx)
    return {op: ops.count(op) for op in set(ops)} | {"griddepcontrol": ptx.count("griddepcontrol")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pdl_keeps_the_memory_instructions(name):
    kernel, sig, consts, opts = CASES[name]
    off = _memory_ops(kernel, sig, consts, opts, False)
    on = _memory_ops(kernel, sig, consts, opts, True)
    assert off.pop("griddepcontrol") == 0 and on.pop("griddepcontrol") == 2
    assert on == off


def test_early_weight_tile_keeps_the_load_widths():
    """The FP8 one-row projection's first weight tile loaded before the wait (``PREFETCH``) is the
    loop's first iteration peeled off: the PTX has the same kinds of loads (widths, vectors) as
    without it. Without PREFETCH nothing is loaded before the wait; with it, some loads are, and
    no more than one weight tile's worth: (BLOCK_N x BLOCK_K bytes) / (16 bytes x 128 threads)
    vector loads per thread. (That they read only the weight is checked on the source:
    test_pdl_contract.py.)"""
    kernel, sig, consts, opts = CASES["fp8_fma"]
    plain = _memory_ops(kernel, sig, consts, opts, True)
    early = _memory_ops(kernel, sig, consts, opts, True, prefetch=True)
    assert plain.pop("griddepcontrol") == 2 and early.pop("griddepcontrol") == 2
    assert set(early) == set(plain), (early, plain)

    def loads_before_wait(prefetch: bool) -> int:
        ptx = _ptx(kernel, sig, consts, opts, True, prefetch)
        return len(re.findall(r"\bld\.global", ptx[:ptx.index("griddepcontrol.wait")]))
    tile_loads = consts["BLOCK_N"] * consts["BLOCK_K"] // (16 * 32 * opts["num_warps"])
    assert loads_before_wait(False) == 0
    assert 0 < loads_before_wait(True) <= tile_loads, (loads_before_wait(True), tile_loads)


@pytest.mark.parametrize("name", ["linear_fma", "fp8_fma"])
def test_relu2_on_load_keeps_the_load_widths(name):
    """relu² applied as x is loaded (``RELU2``, the relu² MLP's down_proj; the register-FMA kernels
    only) adds arithmetic, not memory instructions: the same loads and stores as without it, vector
    widths included, and more float32 multiplies (the squares)."""
    kernel, sig, consts, opts = CASES[name]
    plain = _memory_ops(kernel, sig, consts, opts, True)
    fused = _memory_ops(kernel, sig, {**consts, "RELU2": True}, opts, True)
    assert fused == plain, (fused, plain)
    muls = [len(re.findall(r"\bmul(?:\.\w+)*\.f32\b", _ptx(kernel, sig, {**consts, "RELU2": r}, opts, True)))
            for r in (False, True)]
    assert muls[1] > muls[0], muls


def test_fp8_row_grid_keeps_the_load_widths():
    """The FP8 one-row kernel over a grid of rows (``ROWS``: float32 rows of 2-8, each a grid row)
    compiles for sm_90 with the same kinds of loads and stores as the one-row launch (its x and y
    only start at another row), here for float32 x and y."""
    kernel, sig, consts, opts = CASES["fp8_fma"]
    sig = {**sig, "x_ptr": "*fp32", "y_ptr": "*fp32", "b_ptr": "*fp32"}
    one = _memory_ops(kernel, sig, consts, opts, True, prefetch=True)
    rows = _memory_ops(kernel, sig, {**consts, "ROWS": True}, opts, True, prefetch=True)
    assert rows == one, (rows, one)


def test_moe_combine_rounds_each_product_before_its_add():
    """The MoE combine as launched (``triton_moe.COMBINE_LAUNCH``) multiplies each pair's output by
    its routing weight and adds it as two float32 operations, as the reference does: with Triton's
    default FP fusion the two became one fma.rn.f32."""
    from hybrid_engine.models.triton_moe import COMBINE_LAUNCH
    kernel, sig, consts, _ = CASES["moe_combine"]
    ptx = _ptx(kernel, sig, consts, COMBINE_LAUNCH, pdl=False)
    assert "mul.rn.f32" in ptx and "fma.rn.f32" not in ptx
    fused = _ptx(kernel, sig, consts, {k: v for k, v in COMBINE_LAUNCH.items() if k != "enable_fp_fusion"},
                 pdl=False)
    assert "fma.rn.f32" in fused                # what the option is there for
