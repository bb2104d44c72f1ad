"""The benchmarks' step clock (benchmarks/common.py) counts decode-only launches: a
generate of n tokens per row is one prefill launch and n - 1 decode launches, and prefill
launches (which take tens of ms under TP) never enter the median."""
import pytest

from benchmarks.common import StepClock
from hybrid_engine import LLM, SamplingParams


@pytest.mark.parametrize("chunk", [None, 16])
def test_step_clock_times_only_decode_launches(chunk):
    kw = {} if chunk is None else dict(max_num_batched_tokens=chunk)
    llm = LLM(device="cpu", max_num_seqs=4, **kw)
    clock = StepClock(llm.engine)
    launches = []
    inner = llm.engine.runner.execute                   # the clock's wrapper: counted from outside it

    def counting(sched):
        launches.append(sched.decode is not None and not sched.new_requests and not sched.other_rows)
        return inner(sched)
    llm.engine.runner.execute = counting
    prompts = [[5 + i] * 30 for i in range(3)]          # 90 prompt tokens: several chunks at 16
    step_s = clock.run(lambda: llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True),
                                            use_tqdm=False))
    assert len(clock.times) == 11 == sum(launches)      # the first token of each row comes from prefill
    assert len(launches) > 11                           # prefill launches happened and were not timed
    gaps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    assert min(gaps) <= step_s <= max(gaps)


def _count_executes(runner) -> list:
    """A list that gets one entry per ``runner.execute`` call from now on (wrapped from outside)."""
    executed = []
    inner = runner.execute

    def counting(sched):
        executed.append(1)
        return inner(sched)
    runner.execute = counting
    return executed


def test_step_timeline_counts_every_step_by_its_plan():
    """StepTimeline.steps_by_plan (spec_real's and spec_step_cost's steps-by-plan): one count per
    executed step, under the class name of the plan that took it (on CPU: the general plans)."""
    from benchmarks.common import StepTimeline
    llm = LLM(device="cpu", max_num_seqs=4, max_num_batched_tokens=16)
    timeline = StepTimeline(llm.engine.runner)
    executed = _count_executes(llm.engine.runner)
    llm.generate([[7] * 30, [9] * 5], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    plans = timeline.steps_by_plan()
    assert sum(plans.values()) == len(executed) > 6
    assert plans.get("MixedPlan", 0) >= 2 and plans.get("DecodeOnlyPlan", 0) >= 1, plans
    timeline.clear()
    llm.generate([[3] * 4], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    plans = timeline.steps_by_plan()
    assert sum(plans.values()) == 3, plans          # one prefill step, two decode steps


def test_step_timeline_groups_steps_by_plan_and_width():
    """StepTimeline (spec_real's steps_by_width): every executed step once, under its plan and the
    drafts it verified; a fixed K = 2 n-gram engine's decode steps verify 2, its prefill steps 0
    (no drafts before them); cuts drop the interval across generate calls."""
    from benchmarks.common import StepTimeline
    from hybrid_engine import SpeculativeConfig
    llm = LLM(device="cpu", max_num_seqs=2, speculative_config=SpeculativeConfig("ngram", 2, adaptive=False))
    timeline = StepTimeline(llm.engine.runner)
    executed = _count_executes(llm.engine.runner)
    for _ in range(2):
        llm.generate([[5, 6, 7] * 8], SamplingParams(max_tokens=10, ignore_eos=True), use_tqdm=False)
        timeline.cut()
    s = timeline.summary(runs=2)
    assert sum(v["steps"] for v in s.values()) * 2 == len(executed)
    assert set(s) == {"MixedPlan/w0", "DecodeOnlyPlan/w2"}, s
    assert s["MixedPlan/w0"]["steps"] == 1
    assert s["DecodeOnlyPlan/w2"]["interval_ms"] > 0
    # one step per run before each cut: 2 intervals fewer than steps
    pairs = [(a, b) for a, b in zip(timeline.steps, timeline.steps[1:]) if a is not None and b is not None]
    assert len(pairs) == len(executed) - 2
