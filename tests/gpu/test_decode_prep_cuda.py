"""``prepare_decode``'s Triton kernel on CUDA against the per-row oracle (tests/engine/decode_prep_cases.py);
several seeds per case, so after the first launch the kernel runs through ``FastLaunch``'s direct path.
``greedy_verify``'s two kernels against theirs (tests/engine/greedy_verify_cases.py)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from decode_prep_cases import CASES, check, with_header  # noqa: E402
from greedy_verify_cases import CASES as GREEDY_VERIFY_CASES  # noqa: E402
from greedy_verify_cases import check as greedy_verify_check  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_cuda(name):
    from hybrid_engine.step.triton_decode_prep import triton_prepare_decode
    for seed in range(3):
        check(triton_prepare_decode, seed=seed, device="cuda", **CASES[name])
        check(with_header(triton_prepare_decode), seed=seed, device="cuda", **CASES[name])


GREEDY_VERIFY_CUDA_CASES = {
    "b64_k3_v131072": dict(B=64, k=3, V=131072),                 # 32 vocabulary chunks per row
    "b4_k5_v131072_nonfinite_ties": dict(B=4, k=5, V=131072, nonfinite=True, ties=True),
    "b16_k1_v4096_bf16": dict(B=16, k=1, V=4096, dtype="bfloat16"),
}


@pytest.mark.parametrize("name", sorted(GREEDY_VERIFY_CUDA_CASES) + [f"cpu:{n}" for n in GREEDY_VERIFY_CASES])
def test_greedy_verify_cuda(name):
    """The fused spec steps' verification (two Triton launches) against the per-row oracle
    (tests/engine/greedy_verify_cases.py), poisoned outputs, larger vocabularies than on CPU."""
    import torch

    from hybrid_engine.step.triton_greedy_verify import greedy_verify
    case = dict(GREEDY_VERIFY_CASES[name[4:]] if name.startswith("cpu:") else GREEDY_VERIFY_CUDA_CASES[name])
    if isinstance(case.get("dtype"), str):
        case["dtype"] = getattr(torch, case["dtype"])
    for seed in range(2):
        greedy_verify_check(greedy_verify, seed=seed, device="cuda", **case)
