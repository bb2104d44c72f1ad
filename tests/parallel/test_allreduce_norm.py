"""The fused tensor-parallel all-reduce + add + RMSNorm kernel (``parallel/allreduce_norm.py``) in
Triton's interpreter: one rank at a time with the peers' side staged by hand, and two ranks as two
processes sharing their buffers, calls back to back over reused slots (``allreduce_norm_cases.py``;
natively on one and two GPUs in tests/gpu/test_tensor_parallel_cuda.py),
and the ``ReducingNorm`` that uses it falling back to all-reduce + norm where it does not fit."""
import sys
from pathlib import Path

import pytest
import torch

from hybrid_engine.models.layers import RMSNorm
from hybrid_engine.parallel.allreduce_norm import AllReduceNorm, allreduce_add_norm_ref
from hybrid_engine.parallel.sharding import ReducingNorm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases  # noqa: E402

CASES = ("w2_rank0_bf16", "w2_rank1_f32_odd_d", "w4_rank2_bf16_full_rows", "w2_rank0_missing_peer",
         "two_processes")


def test_kernel_in_interpreter():
    # one process: "two_processes" starts two ranks that spin on each other's flags, and a second
    # shard beside them on a 2-core machine slows them down more than it saves
    res = run_cases(HERE / "allreduce_norm_cases.py", shards=1)
    for name in CASES:
        assert_case(res, name)
    assert_compiles_for_sm90(res)       # as launched, the kernels also compile for the GPU


def test_reference_is_residual_plus_rank_order_sum_then_norm():
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 16, generator=g) * 2 for _ in range(3)]
    res, w = torch.randn(3, 16, generator=g), torch.randn(16, generator=g)
    out, r = allreduce_add_norm_ref(parts, res, w, 1e-6)
    assert torch.equal(r, res + ((parts[0] + parts[1]) + parts[2]))
    norm = RMSNorm(16, 1e-6)
    norm.weight.data.copy_(w)
    torch.testing.assert_close(out, norm(r))


class _Fused:
    """Stands in for AllReduceNorm: records calls, fits steps of at most 2 rows."""
    max_rows = 2

    def __init__(self):
        self.calls = []

    def fits(self, x):
        return x.shape[0] <= self.max_rows

    def __call__(self, x, residual, weight, eps, slot):
        self.calls.append((x.shape[0], slot))
        return torch.zeros_like(x), torch.zeros_like(x)


@pytest.mark.parametrize("rows,fused_calls", [(2, 1), (3, 0)])
def test_reducing_norm_fuses_small_steps_and_reduces_then_norms_larger_ones(rows, fused_calls):
    reduced = []
    fused = _Fused()
    norm = ReducingNorm(8, 1e-6, all_reduce=lambda t: reduced.append(t.shape[0]) or t * 2, fused=fused, slot=5)
    norm.weight.data.normal_()
    x, res = torch.randn(rows, 8), torch.randn(rows, 8)
    out, r = norm.add_norm(x, res)
    assert len(fused.calls) == fused_calls and reduced == ([] if fused_calls else [rows])
    if fused_calls:
        assert fused.calls == [(rows, 5)]
    else:       # the unfused path: all-reduce (here x2), then the plain add + norm
        want_out, want_r = RMSNorm.add_norm(norm, x * 2, res)
        assert torch.equal(r, want_r) and torch.equal(out, want_out)


class _Group:
    """A TPGroup stand-in of two ranks; the peer reports what this rank reports, or ``peer_says``
    for the path decisions (strings / None) when given."""

    def __init__(self, device, peer_says=None):
        self.rank, self.size, self.device, self.peer_says = 0, 2, torch.device(device), peer_says

    def all_gather_object(self, obj):
        if self.peer_says is not None and (obj is None or isinstance(obj, str)):
            return [obj, self.peer_says]
        return [obj, obj]


def test_create_is_none_on_cpu_and_falls_back_loudly_where_symmetric_memory_fails(caplog, monkeypatch):
    assert AllReduceNorm.create(_Group("cpu"), slots=2, hidden=8, dtype=torch.float32) is None
    # a CUDA group on a machine where symmetric memory cannot be set up: None, and the reason logged
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    with caplog.at_level("WARNING", logger="hybrid_engine"):
        assert AllReduceNorm.create(_Group("cuda:0"), slots=2, hidden=8, dtype=torch.float32) is None
    assert "all-reduce + norm unfused" in caplog.text
    monkeypatch.setenv("HYBRID_ENGINE_TP_FUSED_NORM", "0")
    caplog.clear()
    with caplog.at_level("WARNING", logger="hybrid_engine"):
        assert AllReduceNorm.create(_Group("cuda:0"), slots=2, hidden=8, dtype=torch.float32) is None
    assert "HYBRID_ENGINE_TP_FUSED_NORM=0" in caplog.text


def test_create_follows_a_peer_that_cannot(caplog, monkeypatch):
    """This rank could (its own checks pass) but the peer cannot: both take the unfused path, and the
    peer's reason is logged (here the peer's reason comes before any allocation)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    monkeypatch.setattr(AllReduceNorm, "allocate", lambda *a, **k: pytest.fail("allocated although the peer said no"))
    with caplog.at_level("WARNING", logger="hybrid_engine"):
        assert AllReduceNorm.create(_Group("cuda:0", peer_says="peer: no NVLink"), slots=2, hidden=8,
                                    dtype=torch.float32) is None
    assert "peer: no NVLink" in caplog.text
