"""End-to-end on CUDA: no hidden host sync on the step path, CUDA graphs == eager, padding isolation."""
import numpy as np
import pytest
import torch

from engine_steps import launch_steps_without_sync
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("method", ["ngram", "draft_model", "mtp"])
def test_async_steps_never_sync_the_host(target, prompts, method):
    """50 async steps with spec on under torch.cuda sync debug mode "error" around launch();
    the only wait is the designated one on the previous step's D2H event (in commit)."""
    spec = SpeculativeConfig(method, 3, model=str(target) if method == "draft_model" else None)
    llm = LLM(target, dtype="bfloat16", device="cuda", max_num_seqs=8, speculative_config=spec)
    eng = llm.engine
    params = SamplingParams(max_tokens=1000, ignore_eos=True)   # 56 steps x up to 1+K tokens never finish
    for p in prompts:
        eng.add_request(eng.make_request(p, params))
    for _ in range(6):                       # warm-up: prefill, allocator and Triton caches
        eng.step()
    launch_steps_without_sync(eng, 50)
    for r in list(eng.scheduler.running):
        eng.abort(r.request_id)


@pytest.mark.parametrize("spec", [None, "draft_model"])
def test_graph_replay_equals_eager(target, prompts, spec):
    cfg = SpeculativeConfig("draft_model", 3, model=str(target)) if spec else None
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(target, dtype="bfloat16", device="cuda", max_num_seqs=8, speculative_config=cfg,
                  enforce_eager=eager, async_scheduling=True)
        from hybrid_engine.step.graphs import CudaGraphExecutor
        assert isinstance(llm.engine.runner.executor, CudaGraphExecutor) != eager
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[True] == outs[False]


def test_padded_rows_never_change_real_rows(target, prompts):
    """3 requests replay the B=4 graph (1 pad row); each equals its run alone (B=1 graph)."""
    llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=8)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:3]]
    assert together == alone


def test_draft_probs_fresh_every_step(target, prompts):
    """Draft probabilities are written every step (vLLM PR 37639 class): rows sum to 1 and change."""
    from hybrid_engine.spec.drafters import draft_model as dm
    seen = []
    orig = dm.DraftModelDrafter.propose

    def record(self, ctx):
        d, q = orig(self, ctx)
        seen.append(q.float().sum(-1).cpu())
        return d, q
    dm.DraftModelDrafter.propose = record
    try:
        llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=4,
                  speculative_config=SpeculativeConfig("draft_model", 2, model=str(target)))
        sp = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)
        llm.generate(prompts[:2], sp, use_tqdm=False)
    finally:
        dm.DraftModelDrafter.propose = orig
    assert len(seen) > 3
    for s in seen:
        torch.testing.assert_close(s, torch.ones_like(s), atol=1e-4, rtol=0)


def test_h2d_staging_never_overwrites_a_pending_copy():
    """Several puts in one step and across RING-1 steps while the GPU is stalled: each copy must
    deliver the values it was given (a reused pinned buffer would deliver later values)."""
    from hybrid_engine.step.transfer import H2D, RING
    h2d = H2D(torch.device("cuda"), capacity=8)           # tiny: forces the grow path too
    got, want = [], []
    torch.cuda._sleep(200_000_000)                         # keep the stream busy while we stage
    for step in range(RING - 1):
        h2d.begin_step()
        for j in range(4):
            v = np.full(5 + j, 100 * step + j, dtype=np.int64)
            got.append(h2d.put(v)[0])
            want.append(v)
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert g.cpu().numpy().tolist() == w.tolist()


@pytest.mark.parametrize("dtype,temperature", [("bfloat16", 0.0), ("float32", 0.8)])
def test_mtp_graphs_equal_eager(target, prompts, monkeypatch, dtype, temperature):
    """MTP drafts from CUDA graph replays (the verify pass and the single-token steps) give the
    eager engine's tokens (greedy in bf16; seeded sampling, where the draft probabilities take
    part in acceptance, in f32), async on; both graphs ran, and every step's draft
    probabilities are fresh distributions."""
    from hybrid_engine.spec.drafters import mtp as mtp_mod
    from hybrid_engine.spec.drafters import mtp_graphs
    calls = {"verify": 0, "step": 0}
    for name in calls:
        orig = getattr(mtp_graphs.MTPGraphs, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            calls[_name] += 1
            return _orig(self, *a, **k)
        monkeypatch.setattr(mtp_graphs.MTPGraphs, name, spy)
    sums = []
    orig_propose = mtp_mod.MTPDrafter.propose

    def record(self, ctx):
        d, q = orig_propose(self, ctx)
        if q is not None:
            sums.append(q.float().sum(-1))
        return d, q
    monkeypatch.setattr(mtp_mod.MTPDrafter, "propose", record)
    params = [SamplingParams(max_tokens=20, temperature=temperature, seed=11 + i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for eager in (True, False):
        llm = LLM(target, dtype=dtype, device="cuda", max_num_seqs=8, enforce_eager=eager,
                  speculative_config=SpeculativeConfig("mtp", 3, adaptive=False), async_scheduling=True)
        assert (llm.engine.drafter.graphs is None) == eager
        # the drafter's own graphs serve the general path: greedy decode steps would otherwise
        # replay whole (MTPStepGraphs, tests/gpu/test_spec_step_graphs.py) and never call them
        llm.engine.runner.drop_fused_plans(proposing_only=True)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[True] == outs[False]
    assert calls["verify"] >= 5 and calls["step"] >= 10, calls
    if temperature:
        assert len(sums) > 5
        for s in sums:
            torch.testing.assert_close(s, torch.ones_like(s), atol=1e-4, rtol=0)


def test_mtp_moe_load_counts_no_graph_pad_rows(target, prompts):
    """The MTP block's MoE counts one token per sequence and pass (``models/mtp.py``): 3 requests
    in a graph bucket of 4 count what the eager engine counts, through the MTP graphs (the general
    path) and through the fused MTP step graphs; a pad row kept at a real row's token would add
    top-k per replay."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    counts, tokens = {}, {}
    for mode in ("eager", "mtp_graphs", "fused"):
        # sync steps: the same steps in every mode, whatever the timing
        llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=8, enforce_eager=mode == "eager",
                  speculative_config=SpeculativeConfig("mtp", 3, adaptive=False), async_scheduling=False)
        if mode == "mtp_graphs":
            llm.engine.runner.drop_fused_plans(proposing_only=True)
        tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts[1:4], params, use_tqdm=False)]
        load = llm.stats()["moe_expert_tokens"]
        counts[mode] = {name: sum(c) for name, c in load.items() if name.startswith("mtp.")}
        del llm
    assert counts["eager"] and all(v > 0 for v in counts["eager"].values()), counts
    assert tokens["mtp_graphs"] == tokens["eager"] == tokens["fused"]
    assert counts["mtp_graphs"] == counts["eager"] == counts["fused"], counts


def test_adaptive_mtp_graphs_equal_eager(target, prompts):
    """Adaptive speculation narrows MTP steps (random weights: to no drafts); the verify-pass
    graphs of every width give the eager engine's greedy tokens."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=8, enforce_eager=eager,
                  speculative_config=SpeculativeConfig("mtp", 3))
        if not eager:
            assert set(llm.engine.drafter.verify_graphs) == {1, 2, 3, 4}
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs[True] == outs[False]
