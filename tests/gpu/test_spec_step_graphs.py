"""Verify steps replayed whole (``step/spec_graphs.py``; the MTP and draft-model subclasses here,
the n-gram one's equality tests are in test_greedy_graphs.py): the same tokens as the eager engine
through arrivals, a sampling row (general path while it runs) and finishing rows, with and without
adaptive speculation; the fused path taken on most steps at fixed K; the MTP and draft-model
drafts equal the general path's; no host sync on any subclass."""
import numpy as np
import pytest

from engine_steps import launch_steps_without_sync, rest_sooner
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.default_model import default_model_dir
from test_greedy_graphs import drive

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mtp_target(model_dirs):
    # attention in the MTP block: its KV follows every step (written inside the fused replay)
    return model_dirs("gpu_mtp_steps", pattern="M-M*-M-", seed=6, num_nextn_predict_layers=1, mtp_pattern="*-")


@pytest.fixture(scope="module")
def small_draft(model_dirs):
    # a different, smaller hybrid with the targets' vocabulary: drafts are often rejected
    return model_dirs("gpu_draft_small", pattern="M*-", seed=8)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("method, plan_name", [("mtp", "MTPStepGraphs"), ("draft_model", "DraftModelStepGraphs")])
def test_spec_step_graphs_equal_eager(mtp_target, small_draft, method, plan_name, async_scheduling, adaptive,
                                      spec_step_log):
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 256, n).tolist() for n in (7, 19, 3, 25, 11, 6, 14, 2)]
    spec = SpeculativeConfig(method, 3, model=str(small_draft) if method == "draft_model" else None,
                             adaptive=adaptive)
    plain = drive(LLM(mtp_target, dtype="float32", device="cuda", max_num_seqs=8, enforce_eager=True,
                      async_scheduling=async_scheduling), prompts)
    eager_llm = LLM(mtp_target, dtype="float32", device="cuda", max_num_seqs=8, enforce_eager=True,
                    async_scheduling=async_scheduling, speculative_config=spec)
    if adaptive:
        rest_sooner(eager_llm)
    eager = drive(eager_llm, prompts)
    spec_step_log.clear()
    llm = LLM(mtp_target, dtype="float32", device="cuda", max_num_seqs=8, async_scheduling=async_scheduling,
              speculative_config=spec)
    if adaptive:
        rest_sooner(llm)                          # rows must come to rest within this short schedule
    plan = next(p for p in llm.engine.runner.plans if type(p).__name__ == plan_name)
    widths = []                                   # (drafts verified, next width) of each fused replay
    replay = plan.replay

    def logged_replay(step, prev, h2d, next_width):
        widths.append((prev.drafts.shape[1], next_width))
        return replay(step, prev, h2d, next_width)
    plan.replay = logged_replay
    fused = drive(llm, prompts)
    assert fused == eager
    # request 5 samples (temperature 0.9): speculation keeps its distribution, not its draws
    assert {i: t for i, t in fused.items() if i != 5} == {i: t for i, t in plain.items() if i != 5}
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    if not adaptive:
        assert sum(spec_step_log) >= 10, sum(spec_step_log)
    else:   # the drafts are mostly rejected: rows come to rest, and width-0 steps replay fused too,
        # those followed by a resting step on the follow-only graphs (the drafter drafts nothing)
        verified = [k for k, _ in widths]
        assert 0 in verified and any(k > 0 for k in verified), widths
        assert (0, 0) in widths, widths           # replayed the follow-only graph (key (B, 0, q, False))
        assert {k for _, k, _, drafting in plan.graphs if not drafting} == {0}


def _fused_and_general_runs(spec, plan_name: str, dtype: str = "float32", general: bool = True):
    """(tokens, drafts proposed, drafts accepted) of the trained default target on code prompts,
    with the fused verify-step plan ``plan_name`` and (``general``) with it dropped (the general path)."""
    import inspect
    import json
    from hybrid_engine.default_model import default_model_dir
    text = inspect.getsource(json.JSONEncoder)      # code the model completes well
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    runs = []
    for fused in (True, False)[:2 if general else 1]:
        llm = LLM(default_model_dir(), dtype=dtype, device="cuda", max_num_seqs=4, speculative_config=spec)
        tok = llm.tokenizer
        prompts = [tok.encode(text[i:i + 600]) for i in (0, 700, 1400)]
        if not fused:
            llm.engine.runner.drop_fused_plans(proposing_only=True)
        assert any(type(p).__name__ == plan_name for p in llm.engine.runner.plans) == fused
        outs = llm.generate(prompts, sp, use_tqdm=False)
        st = llm.stats()
        runs.append(([o.outputs[0].token_ids for o in outs], st["drafts_proposed"], st["drafts_accepted"]))
        del llm
    return runs


@pytest.mark.parametrize("draft_vocab_size", [None, 2048])
def test_mtp_step_graphs_propose_the_general_paths_drafts(draft_vocab_size):
    """The drafts themselves (not only the tokens, which greedy verification fixes whatever the
    drafts are) equal the general path's, on the trained default model, where most drafts are
    accepted: the same tokens and the same accepted count, with the fused plan and without it;
    also with drafts over half the vocabulary (the graphs capture the reduced head)."""
    spec = SpeculativeConfig("mtp", 3, adaptive=False, draft_vocab_size=draft_vocab_size)
    runs = _fused_and_general_runs(spec, "MTPStepGraphs")
    assert runs[0] == runs[1]
    # a real test of the drafts (47% accepted on CPU with the whole vocabulary)
    assert runs[0][2] > (0.3 if draft_vocab_size is None else 0.2) * runs[0][1], runs[0][1:]


def test_draft_model_step_graphs_propose_the_general_paths_drafts():
    """The drafts equal the general path's (same tokens, same proposed and accepted counts), on the
    trained default target and draft, where many drafts are accepted: a wrong fork, position or
    slot in the fused proposal shows as a lower acceptance."""
    from hybrid_engine.default_model import default_draft_model_dir
    spec = SpeculativeConfig("draft_model", 3, model=str(default_draft_model_dir()), adaptive=False)
    runs = _fused_and_general_runs(spec, "DraftModelStepGraphs")
    assert runs[0] == runs[1]
    assert runs[0][2] > 0.2 * runs[0][1], runs[0][1:]


@pytest.mark.parametrize("method", ["ngram", "mtp", "draft_model"])
def test_spec_step_graphs_never_sync_the_host(mtp_target, small_draft, spec_step_log, method):
    draft = str(small_draft) if method == "draft_model" else None
    llm = LLM(mtp_target, dtype="bfloat16", device="cuda", max_num_seqs=4,
              speculative_config=SpeculativeConfig(method, 3, model=draft, adaptive=False))
    eng = llm.engine
    rng = np.random.default_rng(2)
    for n in (5, 9, 13):
        eng.add_request(eng.make_request(rng.integers(3, 256, n).tolist(),
                                         SamplingParams(max_tokens=400, ignore_eos=True)))
    for _ in range(4):
        eng.step()
    spec_step_log.clear()
    launch_steps_without_sync(eng, 30)
    assert all(spec_step_log) and len(spec_step_log) == 30


@pytest.mark.parametrize("method, plan_name", [("ngram", "NgramStepGraphs"), ("mtp", "MTPStepGraphs"),
                                               ("draft_model", "DraftModelStepGraphs")])
def test_forced_acceptance_replays_fused_with_the_general_paths_tokens(mtp_target, small_draft, method, plan_name,
                                                                       spec_step_log):
    """Forced acceptance (benchmarks) runs in the fused verify-step graphs, drawing the general
    path's coins: the same tokens as an engine whose verify steps all take the general path, and
    the fused plan serves most steps (before, forced runs measured the general path only)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, n).tolist() for n in (7, 19, 3, 25, 11, 6, 14, 2)]
    spec = SpeculativeConfig(method, 3, model=str(small_draft) if method == "draft_model" else None,
                             forced_acceptance_rate=0.7)
    kw = dict(dtype="float32", device="cuda", max_num_seqs=8, speculative_config=spec)
    general = LLM(mtp_target, **kw)
    general.engine.runner.drop_fused_plans(proposing_only=True)
    spec_step_log.clear()
    want = drive(general, prompts)
    assert sum(spec_step_log) == 0
    llm = LLM(mtp_target, **kw)
    assert any(type(p).__name__ == plan_name for p in llm.engine.runner.plans)
    got = drive(llm, prompts)
    assert got == want
    assert sum(spec_step_log) >= 10, sum(spec_step_log)


def test_single_token_meta_on_cuda():
    """The fused proposals' metadata kernel natively (tests/spec/single_token_cases.py: against
    ``single_token_batch`` built step by step), and the MTP input's two norms written side by side
    equal their cat, bit for bit."""
    import sys
    from pathlib import Path

    import torch
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "spec"))
    from single_token_cases import CASES, run_case
    for name, case in CASES.items():
        run_case(case, device="cuda")
    from hybrid_engine.models.rmsnorm import rmsnorm, rmsnorm_into
    g = torch.Generator(device="cuda").manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        e = torch.randn(5, 1000, device="cuda", generator=g).to(dtype) * 3
        h = torch.randn(5, 1000, device="cuda", generator=g).to(dtype)
        we, wh = torch.rand(1000, device="cuda", generator=g).to(dtype) + 0.5, torch.randn(1000, device="cuda").to(dtype)
        out = torch.full((5, 2000), float("nan"), device="cuda", dtype=dtype)
        rmsnorm_into(e, we, 1e-5, out[:, :1000])
        rmsnorm_into(h, wh, 1e-5, out[:, 1000:])
        assert torch.equal(out, torch.cat([rmsnorm(e, we, 1e-5), rmsnorm(h, wh, 1e-5)], -1))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("method, plan_name", [("mtp", "MTPStepGraphs"), ("draft_model", "DraftModelStepGraphs")])
def test_fp8_drafters_propose_the_general_paths_drafts(method, plan_name, dtype):
    """FP8 drafter copies (``SpeculativeConfig.quantization``) on CUDA, in a bfloat16 and a float32
    engine: the FP8 decode kernels inside the captured proposal give the general path's drafts
    (same tokens, same counts), and they are accepted about as often as the unquantized drafter's
    (a wrong scale or a wrong head shows as far fewer)."""
    from dataclasses import replace
    from hybrid_engine.default_model import default_draft_model_dir
    from hybrid_engine.quantization.linear import Fp8Linear
    from hybrid_engine.spec.drafters.draft_quant import FewRowsFp8
    draft = str(default_draft_model_dir()) if method == "draft_model" else None
    spec = SpeculativeConfig(method, 3, model=draft, adaptive=False, quantization="fp8")
    runs = _fused_and_general_runs(spec, plan_name, dtype=dtype)
    assert runs[0] == runs[1]
    (_, proposed, accepted), = _fused_and_general_runs(replace(spec, quantization=None), plan_name,
                                                       dtype=dtype, general=False)
    assert runs[0][2] > 0.85 * accepted and accepted > 0.3 * proposed, (runs[0][1:], proposed, accepted)
    llm = LLM(default_model_dir(), dtype=dtype, device="cuda", max_num_seqs=4, speculative_config=spec)
    head = llm.engine.drafter.draft_logits.head if method == "mtp" else llm.engine.drafter.model.lm_head
    assert isinstance(head, FewRowsFp8) and isinstance(head.narrow, Fp8Linear)


def test_draft_models_prefill_steps_replay_its_prefill_graphs():
    """The draft model's replay of a prefill step replays the draft's own prefill graphs (captured
    on first use, as the target's; eagerly its forward over a prompt was host time the next step
    waited for): the same tokens as with prefill graphs off, the draft executor holding captured
    graphs only then, and its drafts accepted as often (a replay that left the draft's state or KV
    wrong would show as far fewer accepted drafts on the trained default model)."""
    import inspect
    import json
    from hybrid_engine.default_model import default_draft_model_dir
    text = inspect.getsource(json.JSONEncoder)
    spec = SpeculativeConfig("draft_model", 3, model=str(default_draft_model_dir()), adaptive=False)
    runs = []
    for prefill_graphs in (True, False):
        llm = LLM(default_model_dir(), dtype="float32", device="cuda", max_num_seqs=4, speculative_config=spec,
                  prefill_cuda_graphs=prefill_graphs)
        prompts = [llm.tokenizer.encode(text[i:i + 600]) for i in (0, 700, 1400)]
        outs = [llm.generate([p], SamplingParams(max_tokens=48, ignore_eos=True), use_tqdm=False)[0] for p in prompts]
        st = llm.stats()
        graphs = llm.engine.drafter.verify_exec.prefill
        assert (graphs is not None and len(graphs.graphs) > 0) == prefill_graphs
        if prefill_graphs:      # prefix caching (on by default): keys pad restores to one, as the target's
            assert graphs.pad_restores and llm.engine.runner.executor.prefill.pad_restores
        runs.append(([o.outputs[0].token_ids for o in outs], st["drafts_proposed"], st["drafts_accepted"]))
        del llm, graphs
    (tokens, proposed, accepted), (eager_tokens, eager_proposed, eager_accepted) = runs
    assert tokens == eager_tokens
    assert eager_accepted > 0.3 * eager_proposed and abs(accepted - eager_accepted) <= 0.1 * eager_accepted, runs
