"""Probabilistic speculative sampling is lossless at the engine level.

Tiny vocabulary, fixed prompt, many seeds: the distribution of the 2nd and 3rd generated tokens
(both produced by verify steps) with a draft model whose q differs from p matches (a) the exact
marginal computed from transformers' softmax and (b) the engine without spec.
"""
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hf_reference import load_hf

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
V = 8
N = 1500
TEMP = 1.0
PROMPT = [3, 5, 4, 6, 7, 3]


def exact_second_token(model_dir) -> np.ndarray:
    """P(t2) = sum_t1 P(t1 | prompt) P(t2 | prompt, t1) under softmax(logits / T)."""
    hf = load_hf(model_dir)
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([PROMPT])).logits[0, -1].double() / TEMP, -1)
        seqs = torch.tensor([PROMPT + [t] for t in range(V)])
        p2 = torch.softmax(hf(seqs).logits[:, -1].double() / TEMP, -1)          # [V, V]
    return (p1[:, None] * p2).sum(0).numpy()


def chi2_stat(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    exp = probs * counts.sum()
    keep = exp >= 5                                     # merge rare bins into one
    obs = np.append(counts[keep], counts[~keep].sum())
    e = np.append(exp[keep], exp[~keep].sum())
    obs, e = obs[e > 0], e[e > 0]
    return float(((obs - e) ** 2 / e).sum()), len(obs) - 1


# chi-square critical values at p = 0.001
CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def two_sample_chi2(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    keep = (a + b) >= 10
    a, b = np.append(a[keep], a[~keep].sum()), np.append(b[keep], b[~keep].sum())
    nz = (a + b) > 0
    a, b = a[nz], b[nz]
    ka, kb = np.sqrt(b.sum() / a.sum()), np.sqrt(a.sum() / b.sum())
    return float(((ka * a - kb * b) ** 2 / (a + b)).sum()), len(a) - 1


@pytest.fixture(scope="module")
def tiny(model_dirs):
    target = model_dirs("lossless_target", pattern="M*", vocab_size=V, seed=11)
    draft = model_dirs("lossless_draft", pattern="M", vocab_size=V, seed=12)
    return target, draft


def sample_tokens(model, spec):
    llm = LLM(model, dtype="float32", device=DEV, max_num_seqs=64, num_kv_blocks=256, speculative_config=spec)
    params = [SamplingParams(max_tokens=3, temperature=TEMP, seed=s, ignore_eos=True) for s in range(N)]
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    toks = np.array([o.outputs[0].token_ids for o in outs])
    return toks, llm.stats()


def test_spec_sampling_matches_target_distribution(tiny):
    target, draft = tiny
    spec_toks, st = sample_tokens(target, SpeculativeConfig("draft_model", 2, model=str(draft)))
    plain_toks, _ = sample_tokens(target, None)
    assert 0 < st["drafts_accepted"] < st["drafts_proposed"]         # q != p: some drafts rejected
    assert not np.array_equal(spec_toks, plain_toks)                   # different draws, same law
    exact = exact_second_token(target)
    counts = np.bincount(spec_toks[:, 1], minlength=V)
    stat, dof = chi2_stat(counts, exact)
    assert stat < CRIT[dof], (stat, dof, counts, exact)
    for col in (1, 2):
        stat, dof = two_sample_chi2(np.bincount(spec_toks[:, col], minlength=V),
                                    np.bincount(plain_toks[:, col], minlength=V))
        assert stat < CRIT[dof], (col, stat, dof)
    # and the test has power: a wrong law (the draft's own) is rejected
    wrong = np.bincount(plain_toks[:, 1], minlength=V).astype(float)
    wrong = np.roll(wrong, 1) / wrong.sum()
    assert chi2_stat(counts, wrong + 1e-9)[0] > CRIT[dof]
