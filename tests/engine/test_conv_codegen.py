"""The prefill conv kernel compiles for sm_90 (no GPU needed): both offset widths, int32 and int64
sequence offsets (the engine passes int64), W = 4 (the published models) and 2. The interpreter
cases' launches are compiled too (``test_launched_kernels_compile_for_sm90``), but their small
tensors always take int32 offsets. The interpreter runs a kernel without Triton's compiler, so it
misses what only the compiler rejects: a name bound to an int64 vector before an ``if`` and to a
float32 tile in one branch ran under the interpreter and failed to compile on the H100."""
import re

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from hybrid_engine.mamba_cache.ops.triton_conv import _conv_varlen_kernel  # noqa: E402

SIG = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", state_ptr="*bf16", qsl_ptr="*i32", slot_ptr="*i32",
           init_ptr="*u8", out_ptr="*bf16", T="i32", Cdim="i32", nseq="i32",
           **{n: "i32" for n in ("sx_t", "sx_c", "sw_c", "sw_w", "ss_s", "ss_c", "ss_k", "so_t", "so_c")})


@pytest.mark.parametrize("offs_i32", [True, False])
@pytest.mark.parametrize("qsl", ["*i32", "*i64"])
@pytest.mark.parametrize("W,block_t,block_c", [(4, 16, 256), (2, 16, 32)])
def test_conv_varlen_kernel_compiles_for_sm90(offs_i32, qsl, W, block_t, block_c):
    consts = dict(W=W, HAS_BIAS=True, SEARCH_ITERS=12, BLOCK_T=block_t, BLOCK_C=block_c, OFFS_I32=offs_i32)
    sig = {n: SIG.get(n, "constexpr") for n in _conv_varlen_kernel.arg_names} | dict(qsl_ptr=qsl)
    ptx = triton.compile(ASTSource(_conv_varlen_kernel, sig, constexprs=consts),
                         target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    assert re.search(r"\bst\.global", ptx) and re.search(r"\bld\.global", ptx)
