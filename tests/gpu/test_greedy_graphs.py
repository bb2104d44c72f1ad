"""Greedy step graphs (prepare + forward + argmax in one replay) against the eager engine: the same
tokens through every transition (requests arriving into a running batch, rows finishing so the
bucket shrinks, a sampling request forcing the general path and leaving again), with the graph
path taken on most steps, and no host sync on it."""
import numpy as np
import torch
import pytest

from engine_steps import launch_steps_without_sync, rest_sooner
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.step import runner as runner_mod

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("gpu_greedy", pattern="M-M*-M-", seed=5)


def drive(llm, prompts, drafts_of=None):
    """A fixed schedule of arrivals and lengths -> {request index: tokens}; ``drafts_of`` (a dict)
    gets {request index: (drafts proposed, drafts accepted)}."""
    eng = llm.engine
    greedy = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (30, 9, 21, 14, 26, 5, 17, 12)]
    sampled = SamplingParams(max_tokens=6, temperature=0.9, seed=7, ignore_eos=True)
    reqs = {}

    def add(i, params):
        r = eng.make_request(prompts[i], params)
        reqs[i] = r
        eng.add_request(r)
    for i in range(3):
        add(i, greedy[i])
    for step in range(60):
        if step == 4:                          # arrivals into a running greedy batch
            add(3, greedy[3])
            add(4, greedy[4])
        if step == 9:                          # a sampling row: general path while it runs
            add(5, sampled)
        if step == 12:
            for i in (6, 7):
                add(i, greedy[i])
        if not eng.has_work():
            break
        eng.step()
    while eng.has_work():
        eng.step()
    if drafts_of is not None:
        drafts_of.update({i: (r.metrics.drafts_proposed, r.metrics.drafts_accepted) for i, r in reqs.items()})
    return {i: list(r.output_token_ids) for i, r in reqs.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_graphs_equal_eager_through_transitions(target, async_scheduling, dtype, graph_path_log):
    """Eager, CUDA graphs without the greedy step graphs, and with them: the same tokens."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, n).tolist() for n in (7, 19, 3, 25, 11, 6, 14, 2)]
    seq = graph_path_log
    outs = {}
    for mode in ("eager", "graphs", "greedy"):
        llm = LLM(target, dtype=dtype, device="cuda", max_num_seqs=8, enforce_eager=mode == "eager",
                  async_scheduling=async_scheduling)
        assert (llm.engine.runner.greedy_graphs is None) == (mode == "eager")
        if mode == "graphs":
            llm.engine.runner.drop_fused_plans()           # the executor's graphs only
        outs[mode] = drive(llm, prompts)
    assert outs["greedy"] == outs["graphs"] == outs["eager"]
    assert all(len(v) > 0 for v in outs["greedy"].values())
    # the graph path ran most decode steps, and was entered from the general path several times
    # (each entry copies the general step's outputs into the buffers the graph reads)
    entries = sum(1 for a, b in zip(seq, seq[1:]) if b and not a)
    assert sum(seq) >= 20 and entries >= 3, (sum(seq), entries)


def test_greedy_graph_steps_never_sync_the_host(target, graph_path_log):
    llm = LLM(target, dtype="bfloat16", device="cuda", max_num_seqs=4)
    eng = llm.engine
    rng = np.random.default_rng(2)
    for n in (5, 9, 13):
        eng.add_request(eng.make_request(rng.integers(3, 256, n).tolist(),
                                         SamplingParams(max_tokens=200, ignore_eos=True)))
    for _ in range(4):
        eng.step()
    graph_path_log.clear()                   # count the measured steps only
    launch_steps_without_sync(eng, 30)
    assert all(graph_path_log) and len(graph_path_log) == 30


@pytest.fixture
def follows_greedy_step_log(monkeypatch):
    """Per step the runner executes, whether the step before it verified no drafts and kept one
    token per row: the only steps a spec engine may replay through the greedy graphs."""
    log = []
    orig_exec = runner_mod.ModelRunner.execute

    def spy_exec(self, sched):
        prev = self.prev
        log.append(prev is not None and prev.drafts.shape[1] == 0 and prev.sampled.shape[1] == 1)
        return orig_exec(self, sched)
    monkeypatch.setattr(runner_mod.ModelRunner, "execute", spy_exec)
    return log


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_adaptive_ngram_rests_on_the_greedy_graphs(target, async_scheduling, graph_path_log,
                                                   follows_greedy_step_log):
    """Adaptive n-gram speculation on random weights accepts ~nothing: once its rows drop to zero
    drafts, its steps replay the fused greedy graphs (the n-gram kernel inside them), and every
    transition (probes, a sampling row, arrivals) keeps the tokens of no speculation, eager. Each
    arrival starts at K drafts and a probe comes every 8 steps, so of this schedule's ~30 steps only
    10-12 follow a zero-draft step (counted on CPU, float32, the same tokens); the greedy graphs
    must take all of those but the few a sampling row or an arrival sends down the general path."""
    from hybrid_engine import SpeculativeConfig
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, n).tolist() for n in (7, 19, 3, 25, 11, 6, 14, 2)]
    eager = drive(LLM(target, dtype="float32", device="cuda", max_num_seqs=8, enforce_eager=True,
                      async_scheduling=async_scheduling), prompts)
    graph_path_log.clear()
    follows_greedy_step_log.clear()
    llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=8, async_scheduling=async_scheduling,
              speculative_config=SpeculativeConfig("ngram", 3))
    rest_sooner(llm)                              # the schedule below was counted under this rule
    assert llm.engine.runner.greedy_graphs is not None
    ngram_plan = next(p for p in llm.engine.runner.plans if type(p).__name__ == "NgramStepGraphs")
    widths = []                                   # drafts verified by each fused n-gram replay
    replay = ngram_plan.replay

    def logged_replay(step, prev, h2d, next_width):
        widths.append(prev.drafts.shape[1])
        return replay(step, prev, h2d, next_width)
    ngram_plan.replay = logged_replay
    assert drive(llm, prompts) == eager
    took, could = graph_path_log, follows_greedy_step_log
    assert len(took) == len(could)
    assert not any(t and not c for t, c in zip(took, could))     # never after a step with drafts
    assert sum(took) >= max(8, sum(could) - 2), (sum(took), sum(could))
    # the first zero-draft step after a drafting step (rows coming to rest) is the n-gram graphs'
    # width-0 replay, not the general path's
    assert 0 in widths and any(w > 0 for w in widths), widths


def _self_repeating_prompts(rng):
    """Prompts that repeat a phrase: the n-gram drafter proposes on them (mixed acceptance)."""
    out = []
    for n in (7, 19, 3, 25, 11, 6, 14, 2):
        phrase = rng.integers(3, 256, max(2, n // 2)).tolist()
        out.append((phrase * 4)[:n + 8])
    return out


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_ngram_step_graphs_equal_eager(target, async_scheduling, adaptive, spec_step_log, graph_path_log):
    """Greedy n-gram verify steps replayed whole (NgramStepGraphs) give the eager tokens through
    arrivals, a sampling row and finishing rows, and take most decode steps. Adaptive (rows coming
    to rest): the resting steps replay the greedy graphs with the n-gram kernel inside, and the
    drafter's histories and the drafts verified per request equal the eager engine's, whose
    drafter runs after each step."""
    from hybrid_engine import SpeculativeConfig
    prompts = _self_repeating_prompts(np.random.default_rng(3))
    spec = SpeculativeConfig("ngram", 3, adaptive=adaptive)
    eager_llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=8, enforce_eager=True,
                    async_scheduling=async_scheduling, speculative_config=spec)
    if adaptive:
        rest_sooner(eager_llm)
    eager_drafts, fused_drafts = {}, {}
    eager = drive(eager_llm, prompts, eager_drafts)
    plain = drive(LLM(target, dtype="float32", device="cuda", max_num_seqs=8, enforce_eager=True,
                      async_scheduling=async_scheduling), prompts)
    spec_step_log.clear()
    graph_path_log.clear()
    llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=8, async_scheduling=async_scheduling,
              speculative_config=spec)
    if adaptive:
        rest_sooner(llm)
    assert any(getattr(p, "proposes", False) for p in llm.engine.runner.plans)
    assert drive(llm, prompts, fused_drafts) == eager == plain
    if not adaptive:
        assert sum(spec_step_log) >= 10, sum(spec_step_log)
    else:
        assert sum(graph_path_log) >= 3, sum(graph_path_log)     # resting steps on the greedy graphs
        assert fused_drafts == eager_drafts, (fused_drafts, eager_drafts)
        # every row's token history as the drafter kept it (the greedy graphs append inside the
        # replay; the eager drafter after each step). Slot 0, the null slot, takes pad rows' appends
        d_eager, d_fused = eager_llm.engine.runner.drafter, llm.engine.runner.drafter
        assert torch.equal(d_eager.length[1:], d_fused.length[1:])
        assert torch.equal(d_eager.history[1:], d_fused.history[1:])
        assert int(d_fused.length[1:].max()) > max(len(q) for q in prompts)
