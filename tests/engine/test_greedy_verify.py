"""``greedy_verify``: the torch twin and the Triton kernels (interpreter on CPU; natively on CUDA in
tests/gpu/test_decode_prep_cuda.py) against a per-row Python oracle: first-index ties, NaN / +inf
/ all -inf positions flagging their row, -1 drafts, several vocabulary chunks, poisoned outputs."""
import sys
from pathlib import Path

import pytest

from hybrid_engine.step.triton_greedy_verify import greedy_verify_ref

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from greedy_verify_cases import CASES, check  # noqa: E402
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases  # noqa: E402


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_ref_matches_oracle(name, seed):
    check(greedy_verify_ref, seed=seed, **CASES[name])


def test_oracle_catches_a_wrong_acceptance():
    """The check fails when one more draft is accepted than the argmax allows (guards the oracle)."""
    def broken(logits, drafts, start, *, tokens_out, num_valid_out, **kw):
        greedy_verify_ref(logits, drafts, start, tokens_out=tokens_out, num_valid_out=num_valid_out, **kw)
        num_valid_out.add_(1)
    with pytest.raises(AssertionError, match="num_valid"):
        check(broken, **CASES["b8_k3_v4096_ties"])


def test_triton_kernels_in_interpreter():
    res = run_cases(HERE / "greedy_verify_cases.py")
    for name in CASES:
        assert_case(res, name)
    assert_compiles_for_sm90(res)       # as launched, the kernels also compile for the GPU


def test_forced_verification_compiles_for_sm90_with_wrapping_products():
    """The forced coins' splitmix chain (module-level constexprs from sampling.rng) compiles for
    sm_90 without a GPU, and its ten 64-bit products (two per mix, five mixes) are PTX
    ``mul.lo.s64``: low 64 bits, i.e. the wrapping int64 arithmetic of rng's torch form (the
    interpreter cases above check the values)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hybrid_engine.step.step_io import NONFINITE
    from hybrid_engine.step.triton_greedy_verify import _verify_kernel
    sig = dict(cmax_ptr="*fp32", cidx_ptr="*i32", drafts_ptr="*i64", start_ptr="*i64", tok_ptr="*i64",
               nv_ptr="*i64", ns_ptr="*i64", pay_ptr="*i64", forced_key_ptr="*i64", forced_rate="fp32", k="i32",
               n_chunks="i32", V="i32", s_dr="i32", s_tok="i32", s_pay="i32")

    def wide_products(forced: bool) -> int:
        consts = dict(NONFINITE_ID=NONFINITE, KP1_PAD=4, NC_PAD=1, FORCED=forced)
        src = ASTSource(_verify_kernel, {n: sig.get(n, "constexpr") for n in _verify_kernel.arg_names},
                        constexprs=consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["ptx"]
        return len(re.findall(r"\bmul\.lo\.s64\b", ptx))
    assert wide_products(True) - wide_products(False) >= 10
