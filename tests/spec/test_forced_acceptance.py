"""Forced acceptance (benchmark only, ``SpeculativeConfig.forced_acceptance_rate``): each draft is
accepted with the given probability whatever the target says."""
import logging
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.spec.rejection import forced_accept

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")


def _case(rows=4000, k=4, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, k + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (rows, k), generator=g)
    drafts[torch.rand(rows, k, generator=g) < 0.2] = -1            # some rows have no draft there
    slots = torch.arange(rows) % 37 + 1
    positions = torch.randint(0, 500, (rows,), generator=g)
    return logits, drafts, slots, positions


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.85])
def test_each_draft_accepted_with_the_rate(rate):
    """Per position j, P(draft j accepted | drafts < j accepted) = rate, within 4.5 standard errors
    (4000 rows: +-0.035 at the first position), so the neighbouring rates of the parametrisation
    (0.25 apart or more) can never pass each other's check."""
    logits, drafts, slots, positions = _case()
    out = forced_accept(logits, drafts, rate, slots, positions)
    num_acc = (out != -1).sum(1) - 1                                   # accepted drafts per row
    for j in range(3):
        reached = (num_acc >= j).sum().item()
        if reached < 300:
            break
        frac = (num_acc >= j + 1).sum().item() / reached
        assert abs(frac - rate) < 4.5 * np.sqrt(rate * (1 - rate) / reached), (j, frac, rate)


def test_emitted_tokens_and_prefix():
    logits, drafts, slots, positions = _case(rows=500)
    argmax = logits.argmax(-1)
    out = forced_accept(logits, drafts, 0.5, slots, positions)
    n = (out != -1).sum(1)
    cols = torch.arange(5)
    assert ((out != -1) == (cols < n[:, None])).all()                   # valid tokens are a prefix
    acc = n - 1
    for r in range(500):
        a = acc[r].item()
        want = [drafts[r, j].item() if drafts[r, j] >= 0 else argmax[r, j].item() for j in range(a)]
        assert out[r, :a].tolist() == want                              # accepted: the drafts
        assert out[r, a].item() == argmax[r, a].item()                  # then the target's token
    assert torch.equal(forced_accept(logits, drafts, 0.0, slots, positions)[:, 0], argmax[:, 0])
    assert (forced_accept(logits, drafts, 0.0, slots, positions)[:, 1:] == -1).all()
    assert (forced_accept(logits, drafts, 1.0, slots, positions) != -1).all()
    # deterministic per (slot, position): the same rows give the same answer
    assert torch.equal(out, forced_accept(logits, drafts, 0.5, slots, positions))


def test_bad_rate_is_refused():
    for bad in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="forced_acceptance_rate"):
            SpeculativeConfig("ngram", 3, forced_acceptance_rate=bad)


@pytest.fixture(scope="module")
def models(model_dirs):
    return (model_dirs("forced_target", pattern="M*-", seed=3),
            model_dirs("forced_draft", pattern="M", seed=4))


@pytest.mark.parametrize("rate", [0.5, 0.9])
def test_engine_acceptance_length_follows_the_rate(models, rate, caplog):
    """A random draft model accepts ~nothing when verified; forced, the engine's acceptance length
    is 1 + r + r^2 + r^3 (K = 3): 1.875 at r = 0.5, 3.44 at r = 0.9 (+-0.25 is > 4 standard
    errors over ~250 steps, and far from the verified run's ~1.0). The warning says it loudly."""
    target, draft = models
    spec = SpeculativeConfig("draft_model", 3, model=str(draft), forced_acceptance_rate=rate)
    with caplog.at_level(logging.WARNING, logger="hybrid_engine"):
        llm = LLM(target, speculative_config=spec, dtype="float32", device=DEV, max_num_seqs=8, block_size=4,
                  num_kv_blocks=400)
    assert "FORCED ACCEPTANCE" in caplog.text
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, 6).tolist() for _ in range(8)]
    n_tok = 80 if rate > 0.7 else 40
    outs = llm.generate(prompts, SamplingParams(max_tokens=n_tok, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == n_tok for o in outs)
    st = llm.stats()
    want = 1 + rate + rate ** 2 + rate ** 3
    assert abs(st["mean_acceptance_length"] - want) < 0.25, (st["mean_acceptance_length"], want)
