"""``prepare_decode``: the torch twin and the Triton kernel (interpreter on CPU; natively on CUDA in
tests/gpu/test_decode_prep_cuda.py) against a per-row Python oracle, with poisoned destinations,
padding rows and K = 0..8; ``FastLaunch``'s direct path and its loud fallback."""
import sys
from pathlib import Path

import pytest
import torch

from hybrid_engine.step.decode_prep import prepare_decode_ref

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from decode_prep_cases import CASES, check  # noqa: E402
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases  # noqa: E402


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_ref_matches_oracle(name, seed):
    check(prepare_decode_ref, seed=seed, **CASES[name])


def test_oracle_catches_a_wrong_field():
    """The check fails when one field is off (guards the oracle itself)."""
    def broken(*a, **kw):
        prepare_decode_ref(*a, **kw)
        a[4].positions.add_(1)
    with pytest.raises(AssertionError, match="pos"):
        check(broken, **CASES["k3_pad"])


def test_triton_kernel_in_interpreter():
    res = run_cases(HERE / "decode_prep_cases.py")
    for name in CASES:
        assert_case(res, name)
    assert_compiles_for_sm90(res)       # as launched, the kernels also compile for the GPU


class _FakeKernel:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` records a normal launch and returns
    ``compiled`` (the handle FastLaunch calls directly afterwards)."""
    arg_names = ["x", "n", "S"]
    __name__ = "fake_kernel"

    def __init__(self, compiled):
        self.normal, self.compiled = [], compiled

    def __getitem__(self, grid):
        def launch(*a, **kw):
            self.normal.append((grid, a, kw))
            return self.compiled
        return launch


class _Handle:
    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def __getitem__(self, grid):
        def run(*a):
            if self.fail:
                raise IndexError("launcher API changed")
            self.calls.append((grid, a))
        return run


def test_fast_launch_direct_path_passes_constexprs_in_order():
    from hybrid_engine.mamba_cache.ops.triton_common import FastLaunch
    handle = _Handle()
    kern = _FakeKernel(handle)
    fl = FastLaunch(kern)
    x = torch.zeros(4)
    fl((2,), x, 3, S=1, num_warps=1)       # first: the normal launch compiles
    fl((2,), x, 7, S=1, num_warps=1)       # then the handle, grid padded to 3 dims, constexprs appended
    assert len(kern.normal) == 1 and handle.calls == [((2, 1, 1), (x, 7, 1))]
    fl((2,), x, 7, S=2, num_warps=1)       # other constexprs: compiled anew
    assert len(kern.normal) == 2


def test_fast_launch_falls_back_loudly(caplog):
    from hybrid_engine.mamba_cache.ops.triton_common import FastLaunch
    kern = _FakeKernel(_Handle(fail=True))
    fl = FastLaunch(kern)
    x = torch.zeros(4)
    with caplog.at_level("WARNING", logger="hybrid_engine"):
        fl((2,), x, 3, S=1)
        fl((2,), x, 4, S=1)                # direct launch raises: warned, launched normally
        fl((2,), x, 5, S=1)                # from now on the normal path, no second warning
    assert len(kern.normal) == 3
    assert caplog.text.count("direct Triton launch") == 1


def test_stage_decode_layout_with_and_without_header():
    """InputBatch.stage_decode: [prev, slot, block-table rows cut to the widest row], with [N, W]
    first in header mode (what the greedy step graphs stage)."""
    import numpy as np
    from hybrid_engine.step.input_batch import InputBatch
    b = InputBatch(4, 64, 8)
    b.slot[:3] = [5, 6, 7]
    b.num_blocks[:3] = [1, 3, 2]
    b.block_table[:3, :4] = [[11, 0, 0, 9], [21, 22, 23, 9], [31, 32, 0, 9]]
    rows, prev = np.array([2, 0]), np.array([1, 0])
    host, w = b.stage_decode(rows, prev)
    assert w == 2 and host.tolist() == [1, 0, 7, 5, 31, 32, 11, 0]
    hdr, w2 = b.stage_decode(rows, prev, header=True)
    assert w2 == 2 and hdr.tolist() == [2, 2] + host.tolist()


def test_set_blocks_writes_only_the_new_tail_and_a_reused_row_starts_clean():
    """InputBatch.set_blocks copies only the ids past those already written (a running request's
    list only grows): the table row equals the whole list through growth, a shorter list is written
    whole, and a row given to another request starts clean."""
    from hybrid_engine.sampling_params import SamplingParams
    from hybrid_engine.scheduling.scheduler_output import NewRequestData
    from hybrid_engine.step.input_batch import InputBatch

    def new(rid):
        return NewRequestData(req_id=rid, epoch=0, token_ids=(5, 6, 7), slot=1, params=SamplingParams(), seed=0)
    b = InputBatch(2, 64, 8)
    row = b.add_request(new("a"))
    blocks = []
    for extra in ([3], [9], [4, 11], []):
        blocks += extra
        b.set_blocks(row, tuple(blocks))
        assert b.block_table[row, :len(blocks)].tolist() == blocks and b.num_blocks[row] == len(blocks)
    b.block_table[row, 0] = 99                     # ids already written are not copied again
    b.set_blocks(row, tuple(blocks + [5]))
    assert b.block_table[row, :5].tolist() == [99, 9, 4, 11, 5]
    b.set_blocks(row, (8, 2))                      # shorter: written whole
    assert b.block_table[row, :2].tolist() == [8, 2] and b.num_blocks[row] == 2
    b.remove_request("a")
    row2 = b.add_request(new("b"))
    b.set_blocks(row2, (6,))
    assert b.block_table[row2, :1].tolist() == [6] and b.num_blocks[row2] == 1
