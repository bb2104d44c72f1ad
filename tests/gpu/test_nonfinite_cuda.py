"""Non-finite logits on CUDA, on every path: eager, CUDA graphs, and the greedy step graphs (where
the check is a gather at the argmax inside the replay). Weights are poisoned in place after a few
decode steps (graphs read them by address), so the poisoned steps run on the path under test:
every request in them ends with "error" naming non-finite logits and gets no token from them;
after the weights are restored the engine serves exactly as before."""
import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.step import greedy_graphs as gg_mod

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("gpu_nonfinite", pattern="M-M*-M-", seed=9)


@pytest.mark.parametrize("mode", ["eager", "graphs", "greedy"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_nonfinite_logits_on_every_cuda_path(target, mode, async_scheduling, monkeypatch):
    llm = LLM(target, dtype="bfloat16", device="cuda", max_num_seqs=4, enforce_eager=mode == "eager",
              async_scheduling=async_scheduling)
    if mode == "graphs":
        llm.engine.runner.drop_fused_plans()
    took = []                   # one entry per step the greedy graphs were asked about: True = replayed
    orig = gg_mod.GreedyStepGraphs.applies

    def spy(self, *a, **k):
        out = orig(self, *a, **k)
        took.append(out)
        return out
    monkeypatch.setattr(gg_mod.GreedyStepGraphs, "applies", spy)
    eng = llm.engine
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    reqs = [eng.make_request(p, params) for p in prompts]
    for r in reqs:
        eng.add_request(r)
    for _ in range(6):
        eng.step()
    n_before = [len(r.output_token_ids) for r in reqs]
    w = eng.model.lm_head.weight
    saved = w[17].clone()
    took.clear()
    with torch.no_grad():
        w[17] = float("nan")
    while eng.has_work():
        eng.step()
    with torch.no_grad():
        w[17] = saved
    for r, n0, ref in zip(reqs, n_before, clean):
        assert r.finish_reason == "error" and "non-finite logits" in r.error
        # at most the tokens of the step already in flight when the weights changed (async)
        assert len(r.output_token_ids) <= n0 + 1 and r.output_token_ids == ref[:len(r.output_token_ids)]
        eng.forget(r)
    if mode == "greedy":
        assert took and took[0], "the poisoned step did not run as a greedy step graph"
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == clean
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
