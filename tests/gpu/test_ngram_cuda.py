"""The n-gram drafter's Triton kernel against its torch path on CUDA (the cases of
tests/spec/ngram_triton_cases.py at engine sizes: long rows and windows, many slots), plus: the
"auto" backend is Triton on CUDA, propose does not synchronise, and it is one kernel launch."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spec"))
from ngram_triton_cases import CASES, compare, make_ctx  # noqa: E402
from hybrid_engine.spec.drafters.ngram import NgramDrafter  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreter_cases_on_cuda(name):
    compare("cuda", **CASES[name])


# engine-like sizes: max_model_len 2048..8192+ (history rows of max_len + 2 (1+K) + 1), 64 slots
BIG = {
    "k1_n1_8k": dict(k=1, min_n=1, max_n=1, max_len=8203, vocab=50, init_len=(1, 8000)),
    "k3_n1_3_2k": dict(k=3, min_n=1, max_n=3, max_len=2057, vocab=8, init_len=(0, 2000)),
    "k4_n2_5_8k_periodic": dict(k=4, min_n=2, max_n=5, max_len=8203, vocab=6, kind="periodic",
                                init_len=(100, 8100)),
    "k2_n1_4_window_1000": dict(k=2, min_n=1, max_n=4, max_len=4096, window=1000, vocab=30,
                                init_len=(0, 4000)),
    "k5_n1_3_window_33": dict(k=5, min_n=1, max_n=3, max_len=600, window=33, vocab=4,
                              init_len=(0, 500)),
    "k3_short_rows": dict(k=3, min_n=1, max_n=3, max_len=64, vocab=2, init_len=(0, 4),
                          restart=0.5),
    "k3_odd_positions": dict(k=3, min_n=1, max_n=3, max_len=300, vocab=3, odd_pos=0.3,
                             init_len=(0, 280)),
    "k3_holes": dict(k=3, min_n=1, max_n=4, max_len=128, vocab=2, kind="holes",
                     init_len=(0, 100), odd_pos=0.2),
    "k3_block_32": dict(k=3, min_n=1, max_n=5, max_len=3000, vocab=40, block=32,
                        init_len=(0, 2900)),
    "k8_n1_5_block_2048": dict(k=8, min_n=1, max_n=5, max_len=8203, vocab=20, block=2048,
                               init_len=(0, 8000)),
}


@pytest.mark.parametrize("name", list(BIG))
def test_big_cases_on_cuda(name):
    n = compare("cuda", num_slots=65, steps=40, seed=100 + list(BIG).index(name), **BIG[name])
    assert n > 0 or "holes" in name


def _drafter(**kw):
    d = NgramDrafter(3, 1, 4, num_slots=9, max_len=4096, device="cuda", **kw)
    for s in range(9):
        d.add_request(s, tuple(int(x) for x in torch.randint(0, 5, (3000,))))
    return d


def _ctx():
    slots = list(range(1, 9))
    sampled = [[1, 2, 3, -1]] * 8
    return make_ctx(slots, sampled, [1, 2, 0, 3, 4, 1, 0, 2], [3000 + j for j in range(8)], 4, "cuda")


def test_auto_backend_is_triton_and_propose_does_not_sync():
    d = _drafter()
    assert d.backend == "triton"
    ctx = _ctx()
    d.propose(ctx)                                      # compile + pending resets
    d.add_request(4, (1, 2, 3))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            drafts, _ = d.propose(ctx)                  # includes a queued reset (flush)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert drafts.shape == (8, 3) and drafts.is_cuda


def test_propose_is_one_kernel_launch():
    from torch.profiler import ProfilerActivity, profile
    d = _drafter()
    ctx = _ctx()
    d.propose(ctx)                                      # compile + pending resets
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        d.propose(ctx)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "ngram" in kernels[0], kernels
