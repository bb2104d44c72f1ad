"""The fused MTP proposal (``MTPStepGraphs._propose``, captured in the verify step's CUDA graph on
GPU) computes the general path's drafts: on CPU, at steady greedy verify steps of a real engine,
the MTP KV cache is snapshotted before ``MTPDrafter.propose`` runs; the fused proposal then runs
from the same cache on the same step and must give the same drafts and leave the cache in the same
state. The trained default target and its MTP block on code make rows accept drafts, so the
newest-sample index (num_valid up to 4) is exercised. (Pad rows, capture and replay:
tests/gpu/test_spec_step_graphs.py.)"""
import inspect
import json

import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.spec.drafters import mtp as mtp_mod
from hybrid_engine.step.mtp_step_graphs import MTPStepGraphs
from hybrid_engine.step.single_token_steps import SingleTokenSteps


def test_fused_mtp_proposal_equals_the_general_paths(monkeypatch):
    from hybrid_engine.default_model import default_model_dir
    llm = LLM(default_model_dir(), dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("mtp", 3, adaptive=False))
    d = llm.engine.drafter
    fused = object.__new__(MTPStepGraphs)                # the proposal alone: no executor, no capture
    fused.drafter, fused.num_spec, fused.block_size = d, 3, llm.engine.cfg.cache.block_size
    fused.single = SingleTokenSteps(4, "cpu")
    checked, accepted = [], []
    orig = mtp_mod.MTPDrafter.propose

    def compare(self, ctx):
        b = ctx.sampled.shape[0]
        steady = bool(ctx.is_decode.all()) and ctx.num_drafts in (None, 3)
        caches = list(self.kv.k) + list(self.kv.v)
        before = [t.clone() for t in caches] if steady else None
        drafts, probs = orig(self, ctx)
        if steady:
            general_drafts, after = drafts.clone(), [t.clone() for t in caches]
            for t, saved in zip(caches, before):
                t.copy_(saved)
            fused.staged = torch.tensor([b])
            fused.max_seq = ctx.forward_batch.attn.max_seq_len + 2 * 3 + 1   # the general path's bound

            class G:
                fb = ctx.forward_batch
            got = fused._propose(G, b, ctx.hidden, ctx.sampled, ctx.num_valid, ctx.input_pos)
            assert torch.equal(got, general_drafts), (got, general_drafts)
            for t, want in zip(caches, after):
                assert torch.equal(t, want)
            checked.append(b)
            accepted.append(int(ctx.num_valid.max()))
        return drafts, probs
    monkeypatch.setattr(mtp_mod.MTPDrafter, "propose", compare)
    text = inspect.getsource(json.JSONEncoder)
    prompts = [llm.tokenizer.encode(text[i:i + 300]) for i in (0, 400, 800)]
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(checked) >= 4 and max(checked) == 3
    assert max(accepted) > 1, accepted
