"""Shared check of a fused verify-step proposal (``MTPStepGraphs._propose``,
``DraftModelStepGraphs._propose``) against its drafter's general path, on CPU: at each steady
greedy verify step of a real engine the drafter's caches are snapshotted before the general
``propose`` runs; the fused proposal then runs from the same caches on the same step and must give
the same drafts and leave the caches in the same state. The fused follow-only step (``_follow``,
the graphs a resting step replays when the next step rests too) must leave the caches as the
general ``propose`` asked for no drafts does, from the same caches on the same step."""
import dataclasses
import inspect
import json

import torch

from hybrid_engine import SamplingParams
from hybrid_engine.step.single_token_steps import SingleTokenSteps


def check_fused_proposal(monkeypatch, llm, drafter_cls, fused_cls, caches_of, k: int = 3) -> None:
    """``caches_of(drafter)`` -> the drafter's cache tensors. Asserts the equality at >= 4 steps,
    one of them a full batch of 3 rows, and that rows accepted drafts on some checked step."""
    d = llm.engine.drafter
    fused = object.__new__(fused_cls)                    # the proposal alone: no executor, no capture
    fused.drafter, fused.num_spec, fused.block_size = d, k, llm.engine.cfg.cache.block_size
    fused.single = SingleTokenSteps(4, "cpu")
    checked, accepted = [], []
    orig = drafter_cls.propose

    def compare(self, ctx):
        b = ctx.sampled.shape[0]
        steady = bool(ctx.is_decode.all()) and ctx.num_drafts in (None, k)
        before = [t.clone() for t in caches_of(self)] if steady else None
        drafts, probs = orig(self, ctx)
        if steady:
            general_drafts, after = drafts.clone(), [t.clone() for t in caches_of(self)]
            for t, saved in zip(caches_of(self), before):
                t.copy_(saved)
            fused.staged = torch.tensor([b])
            # the general eager path's single-token length bound (the fused one is its step graphs'
            # bound; CPU attention sizes only its scratch by it)
            fused.max_seq = ctx.forward_batch.attn.max_seq_len + 2 * k + 1

            class G:
                fb = ctx.forward_batch
            got = fused._propose(G, b, ctx.hidden, ctx.sampled, ctx.num_valid, ctx.input_pos)
            assert torch.equal(got, general_drafts), (got, general_drafts)
            for t, want in zip(caches_of(self), after):
                assert torch.equal(t, want)
            # no drafts for the next step: the general path's follow, then the fused one, from the
            # same caches (and the fused one must change them: not a no-op)
            for t, saved in zip(caches_of(self), before):
                t.copy_(saved)
            none, _ = orig(self, dataclasses.replace(ctx, num_drafts=0))
            assert none.shape == (b, 0)
            followed = [t.clone() for t in caches_of(self)]
            for t, saved in zip(caches_of(self), before):
                t.copy_(saved)
            assert fused._follow(G, b, ctx.hidden, ctx.sampled, ctx.num_valid, ctx.input_pos) is None
            for t, want in zip(caches_of(self), followed):
                assert torch.equal(t, want)
            assert any(not torch.equal(t, was) for t, was in zip(followed, before))
            for t, want in zip(caches_of(self), after):    # the drafting step's state goes on
                t.copy_(want)
            checked.append(b)
            accepted.append(int(ctx.num_valid.max()))
        return drafts, probs
    monkeypatch.setattr(drafter_cls, "propose", compare)
    text = inspect.getsource(json.JSONEncoder)          # code the trained pair completes well
    prompts = [llm.tokenizer.encode(text[i:i + 300]) for i in (0, 400, 800)]
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert len(checked) >= 4 and max(checked) == 3
    assert max(accepted) > 1, accepted                  # rows accepted drafts on some checked steps
