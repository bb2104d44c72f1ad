"""Adaptive speculation (spec/adaptive.py) in the engine: per request the number of drafts shrinks
while its drafts are rejected (down to none) and grows back when they are accepted again; outputs
never change. The policy alone: tests/spec/test_adaptive_policy.py."""
import os

import numpy as np
import pytest

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.spec import drafters as drafters_mod
from hybrid_engine.spec.drafters.draft_model import make_draft_model
from hf_reference import hf_greedy

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")


def test_step_cost_option_is_checked_and_refused_where_it_cannot_work(target):
    with pytest.raises(TypeError, match="adaptive_step_cost"):
        SpeculativeConfig("ngram", 2, adaptive_step_cost=1)
    with pytest.raises(ValueError, match="adaptive_step_cost"):
        SpeculativeConfig("ngram", 2, adaptive=False, adaptive_step_cost=True)
    with pytest.raises(ValueError, match="forced_acceptance_rate"):
        SpeculativeConfig("ngram", 2, adaptive_step_cost=True, forced_acceptance_rate=0.5)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(target, device="cpu", tensor_parallel_size=2,
            speculative_config=SpeculativeConfig("ngram", 2, adaptive_step_cost=True))


# ---- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("spec_target", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(3, 256, n).tolist() for n in (5, 19, 2, 31)]


class Phases:
    """A drafter wrapper: the target itself as draft (every draft accepted), except during the
    steps where ``bad(step)`` is true, when each draft is replaced by a wrong token. Records the
    width of every proposal (the drafts the next step verifies)."""

    def __init__(self, inner, bad):
        self.inner, self.bad, self.step, self.widths = inner, bad, 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_request(self, slot, token_ids):
        self.inner.add_request(slot, token_ids)

    def propose(self, ctx):
        drafts, probs = self.inner.propose(ctx)
        self.widths.append(drafts.shape[1])
        if self.bad(self.step):
            drafts = (drafts + 1) % 256
        self.step += 1
        return drafts, probs


def _run(target, prompts, spec, bad=None, params=None, monkeypatch=None, timed=False, **kw):
    """``timed`` False: the policy's acceptance rule alone (no cost gate): these tests count width
    schedules, which host timing (a loaded machine) would move."""
    holder = {}
    if bad is not None:
        def factory(build):
            holder["d"] = Phases(make_draft_model(build), bad)
            return holder["d"]
        monkeypatch.setitem(drafters_mod.DRAFTERS, "draft_model", factory)
    args = dict(dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                num_kv_blocks=96)
    args.update(kw)
    llm = LLM(target, speculative_config=spec, **args)
    if not timed and spec is not None and spec.adaptive and not spec.adaptive_step_cost:
        llm.engine.runner.policy.stop_timing()
    outs = llm.generate(prompts, params or SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    return [o.outputs[0].token_ids for o in outs], holder.get("d")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_width_follows_acceptance_and_greedy_output_is_unchanged(target, prompts, monkeypatch, async_scheduling):
    """Good drafts, then 46 steps of wrong drafts, then good again: the step width drops to 0
    (a plain decode step) and comes back to K; the tokens equal transformers' greedy throughout."""
    ref = hf_greedy(target, prompts[:1], max_new_tokens=120)
    spec = SpeculativeConfig("draft_model", 3, model=str(target))
    outs, d = _run(target, prompts[:1], spec, bad=lambda i: 4 <= i < 50, monkeypatch=monkeypatch,
                   params=SamplingParams(max_tokens=120, ignore_eos=True), async_scheduling=async_scheduling)
    assert outs == ref
    w = d.widths
    assert w[:3] == [3, 3, 3]                                   # starts with every draft
    assert 0 in w[8:50]                                         # rejected drafts: no drafting at all
    zero_at = w.index(0)
    assert w[-1] == 3 and 3 in w[zero_at:]                      # grows back once drafts are good again


def test_fixed_and_adaptive_and_no_spec_agree_with_a_mixed_batch(target, prompts, monkeypatch):
    """Rows join and leave mid-run while widths change (mixed steps, every width 0..K): greedy
    output of adaptive == fixed K == no speculation; seeded sampling with a one-hot drafter too."""
    plain, _ = _run(target, prompts, None)
    fixed, _ = _run(target, prompts, SpeculativeConfig("draft_model", 3, model=str(target), adaptive=False),
                    bad=lambda i: 5 <= i < 35, monkeypatch=monkeypatch)
    adaptive, d = _run(target, prompts, SpeculativeConfig("draft_model", 3, model=str(target)),
                       bad=lambda i: 5 <= i < 35, monkeypatch=monkeypatch)
    assert fixed == plain and adaptive == plain
    assert set(d.widths) >= {0, 3}
    sp = [SamplingParams(max_tokens=24, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(len(prompts))]
    plain_s, _ = _run(target, prompts, None, params=sp)
    ngram_s, _ = _run(target, prompts, SpeculativeConfig("ngram", 3), params=sp)
    assert ngram_s == plain_s


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_step_cost_policy_keeps_greedy_output(target, prompts, monkeypatch, async_scheduling):
    """adaptive_step_cost on a real engine (widths chosen from host timings, so they vary from run
    to run): the tokens equal transformers' greedy, and the policy timed steps of several widths."""
    ref = hf_greedy(target, prompts, max_new_tokens=40)
    spec = SpeculativeConfig("draft_model", 3, model=str(target), adaptive_step_cost=True)
    llm_outs, d = _run(target, prompts, spec, bad=lambda i: 10 <= i < 30, monkeypatch=monkeypatch,
                       async_scheduling=async_scheduling)
    assert llm_outs == ref
    assert len(set(d.widths)) >= 2, d.widths


def test_random_weights_rest_at_zero_drafts(target, prompts, monkeypatch):
    """n-gram on random weights accepts almost nothing: after a few steps nearly every step
    verifies no drafts (it costs a plain decode step)."""
    holder = {}
    real = drafters_mod.DRAFTERS.get("ngram")
    if real is None:
        drafters_mod._register_builtin()
        real = drafters_mod.DRAFTERS["ngram"]

    def factory(build):
        holder["d"] = Phases(real(build), lambda i: False)
        return holder["d"]
    monkeypatch.setitem(drafters_mod.DRAFTERS, "ngram", factory)
    llm = LLM(target, speculative_config=SpeculativeConfig("ngram", 4), dtype="float32", device=DEV,
              max_num_seqs=4, block_size=4, num_kv_blocks=96)
    llm.generate(prompts[:1], SamplingParams(max_tokens=80, ignore_eos=True), use_tqdm=False)
    w = holder["d"].widths
    assert w[0] == 4
    tail = w[20:]
    assert sum(x > 0 for x in tail) <= len(tail) // 6
