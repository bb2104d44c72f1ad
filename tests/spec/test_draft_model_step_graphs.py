"""The fused draft-model proposal (``DraftModelStepGraphs._propose``, captured in the verify
step's CUDA graph on GPU) computes the general path's drafts: on CPU, at steady greedy verify
steps of a real engine, the draft's caches are snapshotted before ``DraftModelDrafter.propose``
runs; the fused proposal then runs from the same caches on the same step and must give the same
drafts and leave the draft's caches in the same state. The trained default target and draft on
code make rows accept drafts (num_valid up to 4), so the accepted-count logic (the newest sample,
the fork from checkpoint a-1) is exercised, not only num_valid = 1. (Not covered here: pad rows,
``__init__`` and the capture and replay themselves: tests/gpu/test_spec_step_graphs.py.)"""
import inspect
import json

import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.spec.drafters import draft_model as dm
from hybrid_engine.step.draft_model_step_graphs import DraftModelStepGraphs
from hybrid_engine.step.single_token_steps import SingleTokenSteps


def _cache_tensors(d):
    return list(d.pool.conv_state) + list(d.pool.ssm_state) + list(d.kv.k) + list(d.kv.v)


def test_fused_proposal_equals_the_general_paths(monkeypatch):
    from hybrid_engine.default_model import default_draft_model_dir, default_model_dir
    llm = LLM(default_model_dir(), dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("draft_model", 3, model=str(default_draft_model_dir()),
                                                   adaptive=False))
    d = llm.engine.drafter
    fused = object.__new__(DraftModelStepGraphs)         # the proposal alone: no executor, no capture
    fused.drafter, fused.num_spec, fused.block_size = d, 3, llm.engine.cfg.cache.block_size
    fused.single = SingleTokenSteps(4, "cpu")
    checked, accepted = [], []
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
            # the general eager path's single-token length bound (the fused one is the draft step
            # graphs' bound; CPU attention sizes only its scratch by it)
            fused.max_seq = ctx.forward_batch.attn.max_seq_len + 2 * 3 + 1

            class G:
                fb = ctx.forward_batch
            got = fused._propose(G, b, ctx.hidden, ctx.sampled, ctx.num_valid, ctx.input_pos)
            assert torch.equal(got, general_drafts)
            for t, want in zip(_cache_tensors(self), after):
                assert torch.equal(t, want)
            checked.append(b)
            accepted.append(int(ctx.num_valid.max()))
        return drafts, probs
    monkeypatch.setattr(dm.DraftModelDrafter, "propose", compare)
    text = inspect.getsource(json.JSONEncoder)          # code the trained pair completes well
    prompts = [llm.tokenizer.encode(text[i:i + 300]) for i in (0, 400, 800)]
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(checked) >= 4 and max(checked) == 3
    assert max(accepted) > 1, accepted                  # rows accepted drafts on some checked steps
