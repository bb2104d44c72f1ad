"""``write_kv_triton`` (the CUDA KV-cache write): the Triton kernel in the interpreter against the
torch form of ``ops.write_kv`` (natively on CUDA in tests/gpu/test_fp8_kv_cuda.py); the dispatch
takes it on CUDA only for tensors it supports."""
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from kv_write_cases import CASES  # noqa: E402
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases  # noqa: E402


def test_triton_kernel_in_interpreter():
    res = run_cases(HERE / "kv_write_cases.py")
    for name in CASES:
        assert_case(res, name)
    assert_compiles_for_sm90(res)       # as launched, the kernel also compiles for the GPU


@pytest.mark.parametrize("what", ["k_rows", "cache", "head_dim", "slots", "slot_stride"])
def test_unsupported_layouts_are_refused(what):
    """Head rows without a unit stride, a non-contiguous cache, k / v whose heads do not match the
    cache's, or a slot vector of another length or stride are not the kernel's: the dispatch then
    keeps the torch form (which raises on the mismatched shapes) and says so once."""
    from hybrid_engine.attention.triton_kv_write import write_kv_supported
    k = torch.zeros(3, 2, 8)
    kc = torch.zeros(4, 4, 2, 8)
    slots = torch.arange(3)
    assert write_kv_supported(k, k, kc, kc, slots)
    if what == "k_rows":
        assert not write_kv_supported(torch.zeros(3, 8, 2).transpose(1, 2), k, kc, kc, slots)
    elif what == "cache":
        assert not write_kv_supported(k, k, torch.zeros(4, 4, 8, 2).transpose(2, 3), kc, slots)
    elif what == "head_dim":
        assert not write_kv_supported(torch.zeros(3, 2, 4), torch.zeros(3, 2, 4), kc, kc, slots)
    elif what == "slots":
        assert not write_kv_supported(k, k, kc, kc, torch.arange(4))
    else:
        assert not write_kv_supported(k, k, kc, kc, torch.arange(6)[::2])
