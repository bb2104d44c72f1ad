"""Shared check of a fused verify-step proposal (``MTPStepGraphs._propose``,
``DraftModelStepGraphs._propose``) against its drafter's general path, on CPU: at each steady
greedy verify step of a real engine the drafter's caches are snapshotted before the general
``propose`` runs; the fused proposal then runs from the same caches on the same step and must give
the same drafts and leave the caches in the same state. The fused follow-only step (``_follow``,
the graphs a resting step replays when the next step rests too) must leave the caches as the
general ``propose`` asked for no drafts does, from the same caches on the same step: at drafting
steps (asked for none there) and, ``at_rest``, at the resting steps of an adaptive engine."""
import dataclasses
import inspect
import json

import torch

from hybrid_engine import SamplingParams
from hybrid_engine.step.single_token_steps import SingleTokenSteps


def check_fused_proposal(monkeypatch, llm, drafter_cls, fused_cls, caches_of, k: int = 3,
                         at_rest: bool = False) -> None:
    """``caches_of(drafter)`` -> the drafter's cache tensors. Asserts the equality at >= 4 steps,
    one of them a full batch of 3 rows, and that rows accepted drafts on some checked step.
    ``at_rest`` (an adaptive engine): every request rests from its admission
    (``AdaptiveDrafts.rest``), and the checked steps are those after which nothing is drafted, where the engine's
    own ``propose`` follows (steps of width 0 whose next step rests too: where the follow-only
    graphs replay) and ``_follow`` must leave the same caches."""
    d = llm.engine.drafter
    if at_rest:      # every request rests from its admission (AdaptiveDrafts.rest, as warm-up does)
        policy = llm.engine.runner.policy
        fresh = policy.reset

        def reset_to_rest(slot):
            fresh(slot)
            policy.rest(slot)
        monkeypatch.setattr(policy, "reset", reset_to_rest)
    rest_checked = []
    fused = object.__new__(fused_cls)                    # the proposal alone: no executor, no capture
    fused.drafter, fused.num_spec, fused.block_size = d, k, llm.engine.cfg.cache.block_size
    fused.single = SingleTokenSteps(4, "cpu")
    checked, accepted = [], []
    orig = drafter_cls.propose

    def compare(self, ctx):
        b = ctx.sampled.shape[0]
        if at_rest:
            return follow_at_rest(self, ctx, b)
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
    def follow_at_rest(self, ctx, b):
        steady = bool(ctx.is_decode.all()) and ctx.num_drafts == 0
        before = [t.clone() for t in caches_of(self)] if steady else None
        drafts, probs = orig(self, ctx)                  # the general path's follow
        if steady:
            after = [t.clone() for t in caches_of(self)]
            for t, saved in zip(caches_of(self), before):
                t.copy_(saved)

            class G:
                fb = ctx.forward_batch
            fused.staged = torch.tensor([b])
            fused.max_seq = ctx.forward_batch.attn.max_seq_len + 2 * k + 1
            assert fused._follow(G, b, ctx.hidden, ctx.sampled, ctx.num_valid, ctx.input_pos) is None
            for t, want in zip(caches_of(self), after):
                assert torch.equal(t, want)
            assert any(not torch.equal(t, was) for t, was in zip(after, before))
            rest_checked.append((b, ctx.sampled.shape[1]))
        return drafts, probs
    monkeypatch.setattr(drafter_cls, "propose", compare)
    text = inspect.getsource(json.JSONEncoder)          # code the trained pair completes well
    prompts = [llm.tokenizer.encode(text[i:i + 300]) for i in (0, 400, 800)]
    llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    if at_rest:      # resting steps of the full batch (15 with this schedule)
        assert len(rest_checked) >= 8 and (3, 1) in rest_checked, rest_checked
        return
    assert len(checked) >= 4 and max(checked) == 3
    assert max(accepted) > 1, accepted                  # rows accepted drafts on some checked steps
