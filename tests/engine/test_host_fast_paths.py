"""Host-side fast paths of the step (chosen from host flags and counts, never from device data)
against the general paths they skip.

- H2D: one packed copy cut back into typed tensors;
- all-greedy steps stage no sampling parameters and use the greedy rejection path: greedy rows
  of a batch that also samples at random (general paths) give the all-greedy batch's tokens;
- decode-only steps skip the decode/prefill concatenations: a run whose steps mix prefill chunks
  into decode steps gives the same tokens as one whose decode steps run alone.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.config import SpeculativeConfig
from hybrid_engine.step.transfer import H2D

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
PROMPTS = [[179, 228] * 3, [170, 88, 54, 39, 250, 105, 178] * 3, [139, 162, 196] * 5, [63, 5, 167, 65, 150] * 9]


def test_h2d_put_round_trips_mixed_dtypes_and_shapes():
    h2d = H2D(torch.device(DEV))
    h2d.begin_step()
    arrays = [np.arange(5, dtype=np.int64), np.arange(3, dtype=np.int32), np.array([True, False, True]),
              np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3), np.zeros(0, np.int64),
              np.arange(6, dtype=np.int32).reshape(3, 2), np.zeros((0, 4), np.int32), np.array([7], np.int64)]
    out = h2d.put(*arrays)
    for a, t in zip(arrays, out):
        assert t.shape == a.shape and str(t.dtype).endswith(str(a.dtype).replace("bool", "bool"))
        assert np.array_equal(t.cpu().numpy(), a)


def run(model_dir, params, spec=None, **kw):
    llm = LLM(model_dir, dtype="float32", device=DEV, speculative_config=spec, **kw)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 3)])
def test_greedy_rows_equal_in_all_greedy_and_mixed_batches(hybrid_dir, spec):
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_model_len=128)
    all_greedy = run(hybrid_dir, greedy, spec, **kw)
    mixed = run(hybrid_dir, [greedy, sampled, greedy, sampled], spec, **kw)
    assert mixed[0] == all_greedy[0] and mixed[2] == all_greedy[2]
    # the sampled rows are the same as in a fully sampled batch (their own keys, general path)
    all_sampled = run(hybrid_dir, sampled, spec, **kw)
    assert mixed[1] == all_sampled[1] and mixed[3] == all_sampled[3]


@pytest.mark.parametrize("spec", [None, SpeculativeConfig("ngram", 2)])
def test_decode_only_steps_equal_steps_mixed_with_prefill(hybrid_dir, spec, monkeypatch):
    from hybrid_engine.step.runner import ModelRunner
    routes = []                                   # per step: (plan class, decode rows?, prefill rows?)
    orig_choose = ModelRunner._choose_plan

    def choose(self, step):
        plan = orig_choose(self, step)
        order = step.order
        routes.append((type(plan).__name__, order is None or any(r.is_decode for r in order),
                       order is not None and not order[-1].is_decode))
        return plan
    monkeypatch.setattr(ModelRunner, "_choose_plan", choose)
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    # one request at a time: every decode step runs alone (decode-only fast paths)
    alone = run(hybrid_dir, params, spec, max_num_seqs=1, max_model_len=128)
    alone_routes, routes[:] = list(routes), []
    # a small token budget: long prompts are chunked while others decode (mixed steps)
    mixed = run(hybrid_dir, params, spec, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=128)
    assert alone == mixed
    # the plan is chosen from the step's rows: decode-only steps take DecodeOnlyPlan, any step with
    # a prefill chunk MixedPlan; both runs really took the routes they compare
    # (on CUDA with graphs on, a greedy decode-only step takes a fused plan: GreedyStepGraphs, or
    # NgramStepGraphs / MTPStepGraphs / DraftModelStepGraphs for a greedy verify step)
    decode_only = ("DecodeOnlyPlan", "GreedyStepGraphs", "NgramStepGraphs", "MTPStepGraphs", "DraftModelStepGraphs")
    for plan, has_decode, has_prefill in alone_routes + routes:
        assert plan == "MixedPlan" if has_prefill else plan in decode_only
    assert sum(p in decode_only for p, _, _ in alone_routes) >= 4 * 5
    assert any(p == "MixedPlan" and d for p, d, _ in routes)          # decode rows beside a prefill chunk


def test_step_scratch_alternates_and_reuses_two_steps_later():
    """A decode-only step's start / next_start buffers: step N+1 must not write the buffer step N
    wrote (N+1 reads it as the previous step's output); step N+2 may reuse it."""
    from hybrid_engine.step.step_constants import StepScratch
    sc = StepScratch(torch.device(DEV))
    seen = []
    for _ in range(4):
        sc.next_step()
        seen.append((sc.i64("start", 5).data_ptr(), sc.i64("next_start", 5).data_ptr(),
                     sc.i64("next_start", 3).data_ptr()))
        assert sc.i64("start", 5).shape == (5,) and sc.i64("start", 5).dtype == torch.int64
    for a, b in zip(seen, seen[1:]):
        assert not set(a) & set(b)                   # consecutive steps share no buffer
    assert seen[0] == seen[2] and seen[1] == seen[3]  # reused two steps later
    assert len(set(seen[0])) == 3                    # names and row counts never alias


def test_fast_launch_keeps_one_runner_per_grid():
    """FastLaunch builds the handle's runner once per grid and passes the right grid each time."""
    from hybrid_engine.mamba_cache.ops.triton_common import FastLaunch

    class Handle:
        def __init__(self):
            self.made, self.calls = [], []

        def __getitem__(self, grid):
            self.made.append(grid)
            return lambda *a: self.calls.append((grid, a))

    class Kernel:
        arg_names = ["x", "n", "S"]
        __name__ = "k"

        def __init__(self, h):
            self.h = h

        def __getitem__(self, grid):
            return lambda *a, **kw: self.h

    h = Handle()
    fl = FastLaunch(Kernel(h))
    x = torch.zeros(4)
    fl((2,), x, 1, S=3)                                # compiles (normal launch)
    for n, grid in ((2, (2,)), (3, (5,)), (4, (2,)), (5, (5,))):
        fl(grid, x, n, S=3)
    assert h.made == [(2, 1, 1), (5, 1, 1)]
    assert h.calls == [((2, 1, 1), (x, 2, 3)), ((5, 1, 1), (x, 3, 3)), ((2, 1, 1), (x, 4, 3)),
                       ((5, 1, 1), (x, 5, 3))]
