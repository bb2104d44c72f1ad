"""``prepare_decode``'s Triton kernel on CUDA against the per-row oracle (tests/engine/decode_prep_cases.py);
several seeds per case, so after the first launch the kernel runs through ``FastLaunch``'s direct path."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from decode_prep_cases import CASES, check, with_header  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_kernel_cuda(name):
    from hybrid_engine.step.triton_decode_prep import triton_prepare_decode
    for seed in range(3):
        check(triton_prepare_decode, seed=seed, device="cuda", **CASES[name])
        check(with_header(triton_prepare_decode), seed=seed, device="cuda", **CASES[name])
