"""Rejection sampler: greedy verification, -1 drafts, losslessness, batch independence."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_reference import NoHostSync

from hybrid_engine.sampling.sampler import SamplingTensors, gumbel_argmax, probs_from_logits, sample
from hybrid_engine.spec.rejection import num_accepted, rejection_sample

# Chi-square critical values at p = 1e-3 (scipy.stats.chi2.isf(1e-3, dof)), used without scipy.
_CHI2_CRIT_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
ALPHA = 1e-3


def _chi2_ok(stat: float, dof: int) -> bool:
    try:
        from scipy.stats import chi2

        return chi2.sf(stat, dof) > ALPHA
    except ImportError:
        return stat < _CHI2_CRIT_1E3[dof]


def matches_probs(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """Goodness of fit of sampled tokens to probs[V]; zero-probability tokens must never appear."""
    obs = torch.bincount(tokens, minlength=probs.numel()).double().numpy()
    p = probs.double().numpy()
    support = p > 0
    assert obs[~support].sum() == 0, (obs, p)
    exp = p[support] / p[support].sum() * obs.sum()
    return _chi2_ok(float(((obs[support] - exp) ** 2 / exp).sum()), int(support.sum()) - 1)


def same_distribution(a: torch.Tensor, b: torch.Tensor, vocab: int) -> bool:
    """Two-sample chi-square (2 x V contingency table) over the categories either sample uses."""
    table = torch.stack([torch.bincount(a, minlength=vocab), torch.bincount(b, minlength=vocab)])
    table = table[:, table.sum(0) > 0].double().numpy()
    exp = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return _chi2_ok(float(((table - exp) ** 2 / exp).sum()), table.shape[1] - 1)


def params(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0):
    return SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)


def greedy_reference(target_logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Row-by-row loop over the contract's greedy rule."""
    r, k1, _ = target_logits.shape
    out = torch.full((r, k1), -1, dtype=torch.int64)
    am = target_logits.argmax(-1)
    for i in range(r):
        for j in range(k1):
            out[i, j] = am[i, j]
            if j == k1 - 1 or drafts[i, j].item() != am[i, j].item():
                break
    return out


def assert_prefix_shape(out: torch.Tensor) -> None:
    valid = out != -1
    n = num_accepted(out)
    assert (n >= 1).all()
    assert torch.equal(valid, torch.arange(out.shape[1]) < n[:, None])  # contiguous prefix


# ---------------------------------------------------------------- greedy

@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_matches_reference(k):
    g = torch.Generator().manual_seed(k)
    rows, vocab = 48, 11
    target = torch.randn(rows, k + 1, vocab, generator=g)
    am = target.argmax(-1)
    first_bad = torch.randint(0, k + 1, (rows,), generator=g)  # k = all accepted
    drafts = am[:, :k].clone()
    for i in range(rows):
        m = int(first_bad[i])
        if m < k:
            drafts[i, m] = -1 if i % 3 == 0 else (am[i, m] + 1) % vocab
            drafts[i, m + 1:] = torch.randint(-1, vocab, (k - m - 1,), generator=g)
    st = SamplingTensors.from_params([params(0.0, seed=i) for i in range(rows)], "cpu")
    out = rejection_sample(target, drafts, None, st, torch.arange(rows) * 5)
    assert torch.equal(out, greedy_reference(target, drafts))
    assert torch.equal(num_accepted(out), torch.minimum(first_bad, torch.tensor(k)) + 1)
    assert_prefix_shape(out)
    # draft probabilities are ignored by greedy rows
    dp = torch.softmax(torch.randn(rows, k, vocab, generator=g), -1)
    assert torch.equal(rejection_sample(target, drafts, dp, st, torch.arange(rows)), out)


def test_greedy_all_accepted_writes_bonus_and_minus_one_never_matches_token_zero():
    target = torch.full((2, 4, 5), -1.0)
    target[:, :, 0] = 5.0  # argmax is token 0 everywhere: a clamped -1 would wrongly match it
    target[1, 3] = torch.tensor([0.0, 0.0, 0.0, 9.0, 0.0])
    drafts = torch.tensor([[0, -1, 0], [0, 0, 0]])
    st = SamplingTensors.from_params([params(0.0)] * 2, "cpu")
    out = rejection_sample(target, drafts, None, st, torch.tensor([0, 0]))
    assert out.tolist() == [[0, 0, -1, -1], [0, 0, 0, 3]]
    none = rejection_sample(target, torch.full((2, 3), -1), None, st, torch.tensor([0, 0]))
    assert none.tolist() == [[0, -1, -1, -1], [0, -1, -1, -1]]


def test_no_drafts_equals_plain_sampling_greedy_and_random():
    g = torch.Generator().manual_seed(9)
    rows, k, vocab = 16, 3, 20
    target = torch.randn(rows, k + 1, vocab, generator=g) * 2
    plist = [params(0.0 if i % 4 == 0 else 0.9, top_k=[-1, 5][i % 2], seed=1000 + i)
             for i in range(rows)]
    st = SamplingTensors.from_params(plist, "cpu")
    pos = torch.arange(rows) + 40
    plain = sample(target[:, 0], st, pos)
    out = rejection_sample(target, torch.full((rows, k), -1), None, st, pos)
    assert torch.equal(out[:, 0], plain) and (out[:, 1:] == -1).all()
    out0 = rejection_sample(target[:, :1], torch.empty(rows, 0, dtype=torch.int64), None, st, pos)
    assert torch.equal(out0[:, 0], plain)


# ---------------------------------------------------------------- probabilistic

def _draw(log_q: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Drafts d[:, j] ~ softmax(log_q[:, j]) keyed like the plain sampler at position pos + j."""
    return torch.stack(
        [gumbel_argmax(log_q[:, j], seeds, pos + j) for j in range(log_q.shape[1])], dim=1
    )


def _lossless_case(n=20000, k=3, vocab=6, top_k=-1):
    target_row = torch.tensor([[1.0, 0.5, -0.3, 0.8, -1.0, 0.0],
                               [0.0, 1.2, 0.4, -0.5, 0.9, -2.0],
                               [-0.7, 0.3, 1.1, 0.2, 0.0, 0.6],
                               [0.5, -0.5, 0.0, 1.5, 0.3, 0.1]])[: k + 1]
    draft_row = torch.tensor([[0.2, 1.4, 0.0, -0.5, 0.5, 0.9],
                              [0.8, 0.0, 1.0, 0.3, -0.4, 0.1],
                              [0.0, 0.9, 0.2, 1.0, -1.0, 0.4]])[:k]
    target = target_row.expand(n, k + 1, vocab)
    seeds = torch.arange(n, dtype=torch.int64) * 31 + 7
    pos = torch.arange(n, dtype=torch.int64) % 97 + 5
    st = SamplingTensors.from_params(
        [params(0.8, top_k=top_k, seed=s) for s in seeds.tolist()], "cpu"
    )
    q = torch.softmax(draft_row, -1).expand(n, k, vocab)
    return target, q, st, seeds, pos


@pytest.mark.parametrize("top_k", [-1, 4])
def test_lossless_with_draft_probs(top_k):
    target, q, st, seeds, pos = _lossless_case(top_k=top_k)
    n, k1, vocab = target.shape
    p = probs_from_logits(target[:1], st)[0]  # [1+K, V], the same for every row
    drafts = _draw(torch.log(q), seeds, pos)
    out = rejection_sample(target, drafts, q, st, pos)
    assert_prefix_shape(out)
    assert 0.3 * n < (out[:, 1] != -1).sum() < 0.9 * n  # a real mix of accepts and rejects
    for j in range(k1):  # column j given that all earlier drafts were accepted, bonus included
        present = out[:, j] != -1
        assert matches_probs(out[:, j][present], p[j]), j
    # and column 0 against the plain sampler on independent keys
    other = SamplingTensors.from_params([params(0.8, top_k=top_k, seed=s + 1) for s in
                                         st.seed.tolist()], "cpu")
    assert same_distribution(out[:, 0], sample(target[:, 0], other, pos), vocab)


@pytest.mark.parametrize("random_drafts", [False, True])
def test_lossless_with_one_hot_drafts(random_drafts):
    """draft_probs None (ngram / greedy drafter): q is the one-hot of the draft, under T > 0."""
    target, q, st, seeds, pos = _lossless_case(n=60000)  # acceptance is low: more rows
    n, k1, vocab = target.shape
    p = probs_from_logits(target[:1], st)[0]
    if random_drafts:
        drafts = _draw(torch.log(q), seeds, pos)
    else:
        drafts = torch.tensor([[0, 1, 2]]).expand(n, 3)  # each column's mode
    out = rejection_sample(target, drafts, None, st, pos)
    assert_prefix_shape(out)
    for j in range(k1):
        present = out[:, j] != -1
        assert present.sum() > 200
        assert matches_probs(out[:, j][present], p[j]), j


def test_draft_equal_to_target_reproduces_plain_sampling():
    """Self-speculation with the sampler's own keys: every draft is accepted, tokens identical."""
    g = torch.Generator().manual_seed(4)
    rows, k, vocab = 64, 4, 50
    target = torch.randn(rows, k + 1, vocab, generator=g) * 2
    st = SamplingTensors.from_params(
        [params(1.1, top_k=[-1, 10][i % 2], top_p=[1.0, 0.9][i % 3 == 0], seed=i)
         for i in range(rows)], "cpu")
    pos = torch.arange(rows) * 7
    plain = torch.stack([sample(target[:, j], st, pos + j) for j in range(k + 1)], 1)
    q = probs_from_logits(target[:, :k], st)
    out = rejection_sample(target, plain[:, :k], q, st, pos)
    assert torch.equal(out, plain)


def test_residual_excludes_rejected_draft_and_falls_back_to_p():
    # q one-hot on token 2 and p puts mass on 2: a rejection can never re-emit token 2.
    n, vocab = 4000, 4
    target = torch.tensor([0.0, 0.5, 1.0, 0.2]).expand(n, 2, vocab).contiguous()
    st = SamplingTensors.from_params([params(1.0, seed=s) for s in range(n)], "cpu")
    pos = torch.zeros(n, dtype=torch.int64)
    out = rejection_sample(target, torch.full((n, 1), 2), None, st, pos)
    rejected = out[:, 1] == -1
    assert rejected.any() and (out[:, 0][rejected] != 2).all()
    # q(d) = 0 with p(d) > 0: u < p/q = inf always accepts.
    p = probs_from_logits(target[:, :1], st)
    q = torch.zeros(n, 1, vocab)
    q[:, 0, 0] = 1.0
    out = rejection_sample(target, torch.full((n, 1), 3), q, st, pos)
    assert (out[:, 0] == 3).all()
    # p(d) = 0 (filtered by top-k): always rejected, and the residual stays inside p's support.
    st1 = SamplingTensors.from_params([params(1.0, top_k=2, seed=s) for s in range(n)], "cpu")
    out = rejection_sample(target, torch.full((n, 1), 0), p, st1, pos)
    assert (out[:, 1] == -1).all() and set(out[:, 0].tolist()) <= {1, 2}


def test_mixed_batch_rows_are_independent_of_batch():
    g = torch.Generator().manual_seed(5)
    rows, k, vocab = 12, 3, 16
    target = torch.randn(rows, k + 1, vocab, generator=g)
    target[:, :, 3] += 2.0  # drafts of 3 get accepted often
    drafts = torch.randint(-1, vocab, (rows, k), generator=g)
    drafts[::2] = 3
    dp = torch.softmax(torch.randn(rows, k, vocab, generator=g), -1)
    plist = [params(0.0 if i % 3 == 0 else 1.0, top_p=[1.0, 0.8][i % 2], seed=50 + i)
             for i in range(rows)]
    pos = torch.arange(rows) * 2 + 1
    out = rejection_sample(target, drafts, dp, SamplingTensors.from_params(plist, "cpu"), pos)
    assert_prefix_shape(out)
    greedy_rows = torch.arange(0, rows, 3)
    assert torch.equal(out[greedy_rows], greedy_reference(target[greedy_rows], drafts[greedy_rows]))
    perm = torch.randperm(rows, generator=g)
    st_perm = SamplingTensors.from_params([plist[i] for i in perm], "cpu")
    assert torch.equal(rejection_sample(target[perm], drafts[perm], dp[perm], st_perm, pos[perm]),
                       out[perm])
    for i in range(rows):
        alone = rejection_sample(target[i:i + 1], drafts[i:i + 1], dp[i:i + 1],
                                 SamplingTensors.from_params([plist[i]], "cpu"), pos[i:i + 1])
        assert torch.equal(alone[0], out[i])




@pytest.mark.parametrize("draft_probs", [False, True])
def test_rejection_does_not_sync(draft_probs):
    rows, k, vocab = 6, 2, 9
    target = torch.randn(rows, k + 1, vocab)
    drafts = torch.tensor([[1, -1], [2, 3], [-1, -1], [0, 0], [4, 5], [8, 1]])
    dp = torch.softmax(torch.randn(rows, k, vocab), -1) if draft_probs else None
    st = SamplingTensors.from_params([params(i % 2 * 1.0, top_k=3, seed=i) for i in range(rows)],
                                     "cpu")
    greedy = SamplingTensors.from_params([params(0.0)] * rows, "cpu")
    pos = torch.arange(rows)
    with NoHostSync():
        num_accepted(rejection_sample(target, drafts, dp, st, pos))
        num_accepted(rejection_sample(target, drafts, dp, greedy, pos))
