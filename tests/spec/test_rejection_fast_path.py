"""The all-greedy fast path of ``rejection_sample`` (chosen from the host flag ``all_greedy``) must
give exactly what the general paths give for temperature-0 rows."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_engine.sampling.sampler import SamplingTensors
from hybrid_engine.spec.rejection import rejection_sample


def greedy_params(r: int) -> SamplingTensors:
    return SamplingTensors(temperature=torch.zeros(r), top_k=torch.full((r,), -1), top_p=torch.ones(r),
                           min_p=torch.zeros(r), seed=torch.arange(r), all_greedy=True, any_filter=False)


@pytest.mark.parametrize("k", [0, 1, 3, 5])
@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_fast_path_equals_general_path(k, with_probs):
    g = torch.Generator().manual_seed(k)
    r, vocab = 64, 11                                   # small vocab: many accepted drafts
    logits = torch.randn(r, 1 + k, vocab, generator=g)
    argmax = logits.argmax(-1)
    # drafts: the target's argmax (accepted), random tokens (mostly rejected) and -1 (no draft)
    drafts = torch.where(torch.rand(r, k, generator=g) < 0.6, argmax[:, :k],
                         torch.randint(0, vocab, (r, k), generator=g))
    drafts = torch.where(torch.rand(r, k, generator=g) < 0.15, -1, drafts)
    probs = torch.softmax(torch.randn(r, k, vocab, generator=g), -1) if with_probs else None
    pos = torch.randint(0, 100, (r,), generator=g)
    st = greedy_params(r)
    fast = rejection_sample(logits, drafts, probs, st, pos)
    # the same rows through the general path: all_greedy off, every temperature still 0
    general = rejection_sample(logits, drafts, probs, dataclasses.replace(st, all_greedy=False), pos)
    assert torch.equal(fast, general)
    n = (fast != -1).sum(1)
    assert (n >= 1).all() and (n <= 1 + k).all()
    if k:
        assert (n > 1).any() and (n < 1 + k).any()     # both accepted and rejected drafts occurred
