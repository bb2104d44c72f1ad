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
from triton_interpret import assert_case, run_cases  # noqa: E402


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
