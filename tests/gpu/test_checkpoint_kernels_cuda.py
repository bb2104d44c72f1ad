"""The prefix-cache checkpoint kernels against their torch twins on CUDA: the emit kernel
(``triton_ssd_emit.emit_states``: the SSM state after chosen tokens, from the SSD scan's chunk
quantities; float32 and bf16 inputs, masked tiles, chunks of several dot steps, one sequence, the
8B shape's head layout: P 64, N 128, 128-token chunks) and the conv-window kernel
(``triton_conv_windows_before``: bit-exact copies, pool untouched), both also storing into
checkpoint rows (``out_rows``). The whole scan with emits against the torch scan:
test_kernels_interpret.py's ``ssd_emit`` cases (CPU) and test_prefix_cache_cuda.py (engine,
caching on == off)."""
import pytest
import torch

import checkpoint_cases as cc
from hybrid_engine.mamba_cache.ops.triton_conv_windows import triton_conv_windows_before
from hybrid_engine.mamba_cache.ops.triton_ssd_emit import emit_states

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    dict(lens=[21, 7, 16, 1], emit=[0, 3, 15, 16, 20, 21, 27, 28, 43, 44], cs=16),
    dict(lens=[70, 5], emit=[0, 31, 32, 47, 48, 69, 74], cs=48, P=20, N=10),
    dict(lens=[40], emit=[0, 15, 16, 39], cs=16),
    dict(lens=[300, 129, 5], emit=[127, 128, 255, 299, 300, 428, 433], cs=128, H=16, G=2, P=64, N=128),
])
def test_emit_kernel_matches_ref(case, dtype):
    cc.check_emit(emit_states, "cuda", dtype, seed=3, **case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_major", [True, False])
def test_conv_windows_kernel_matches_ref(dtype, token_major):
    cc.check_conv_windows(triton_conv_windows_before, "cuda", dtype, [5, 1, 9, 2, 300],
                          [(0, 0), (0, 1), (0, 2), (0, 4), (1, 0), (2, 0), (2, 1), (2, 8), (3, 1), (4, 299)],
                          C=1536, seed=4, token_major=token_major)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_kernels_store_into_rows(dtype):
    """``out_rows``: each state / window stored at its checkpoint row of a larger buffer (what the
    mixer passes: the layer's checkpoint rows), the other rows untouched."""
    cc.check_emit(emit_states, "cuda", dtype, [300, 129, 5], [127, 128, 299, 300, 433], 128, H=16, G=2, P=64,
                  N=128, seed=5, rows=True)
    cc.check_conv_windows(triton_conv_windows_before, "cuda", dtype, [5, 9, 300], [(0, 0), (1, 8), (2, 299)],
                          C=1536, seed=6, rows=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restore_kernel_matches_ref(dtype):
    """The restore's two launches against the torch twin, at a published width (Nano: 64 heads
    x 64 x 128 state, conv 6144 channels), into NaN pools."""
    from hybrid_engine.mamba_cache.ops.triton_restore import triton_restore_rows
    cc.check_restore(triton_restore_rows, "cuda", dtype, L=3, R=4, S=5, C=6144, W=4, K=3, H=64, P=64, N=128,
                     slots=(3, 1, 0), rows=(0, 3, -1), seed=7)
