"""The fused draft-model proposal (``DraftModelStepGraphs._propose``, captured in the verify
step's CUDA graph on GPU) computes the general path's drafts: on CPU, at steady greedy verify
steps of a real engine, the draft's caches are snapshotted before ``DraftModelDrafter.propose``
runs; the fused proposal then runs from the same caches on the same step and must give the same
drafts and leave the draft's caches in the same state. (The replay itself, pads and graphs, is
tested on the GPU: tests/gpu/test_spec_step_graphs.py.)"""
import numpy as np
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.spec.drafters import draft_model as dm
from hybrid_engine.step.draft_model_step_graphs import DraftModelStepGraphs


def _cache_tensors(d):
    return list(d.pool.conv_state) + list(d.pool.ssm_state) + list(d.kv.k) + list(d.kv.v)


def test_fused_proposal_equals_the_general_paths(model_dirs, monkeypatch):
    target = model_dirs("spec_target", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)
    draft = model_dirs("fused_draft", pattern="M*-", seed=8)
    llm = LLM(target, dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("draft_model", 3, model=str(draft), adaptive=False))
    d = llm.engine.drafter
    fused = object.__new__(DraftModelStepGraphs)         # the proposal alone: no executor, no capture
    fused.drafter, fused.num_spec, fused.block_size = d, 3, llm.engine.cfg.cache.block_size
    checked = []
    orig = dm.DraftModelDrafter.propose

    def compare(self, ctx):
        b = ctx.sampled.shape[0]
        steady = bool(ctx.is_decode.all()) and ctx.num_drafts in (None, 3)
        before = [t.clone() for t in _cache_tensors(self)] if steady else None
        drafts, probs = orig(self, ctx)
        if steady:
            general_drafts, after = drafts.clone(), [t.clone() for t in _cache_tensors(self)]
            for t, saved in zip(_cache_tensors(self), before):
                t.copy_(saved)
            fused.staged = torch.tensor([b])
            # the fused path's single-token length bound; on CPU attention does not split by it
            fused.max_seq = ctx.forward_batch.attn.max_seq_len + 2 * 3 + 1

            class G:
                fb = ctx.forward_batch
            got = fused._propose(G, b, ctx.hidden, ctx.sampled, ctx.num_valid, ctx.input_pos)
            assert torch.equal(got, general_drafts)
            for t, want in zip(_cache_tensors(self), after):
                assert torch.equal(t, want)
            checked.append(b)
        return drafts, probs
    monkeypatch.setattr(dm.DraftModelDrafter, "propose", compare)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 250, n).tolist() for n in (5, 12, 3)]
    llm.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True), use_tqdm=False)
    assert len(checked) >= 5 and max(checked) == 3
