"""Sampler and counter-based RNG: masks, determinism, distribution, no host sync."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hf_reference import NoHostSync

from hybrid_engine.sampling import rng
from hybrid_engine.sampling.sampler import SamplingTensors, filtered_logits, probs_from_logits, sample

# Critical values of the chi-square distribution at p = 1e-3 (scipy.stats.chi2.isf(1e-3, dof)),
# used when scipy is not installed.
_CHI2_CRIT_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def chi2_consistent(observed, expected_probs, alpha=1e-3) -> bool:
    """Goodness of fit of counts to probabilities; categories with zero probability must be empty."""
    observed = np.asarray(observed, dtype=np.float64)
    probs = np.asarray(expected_probs, dtype=np.float64)
    support = probs > 0
    assert observed[~support].sum() == 0, (observed, probs)
    obs, exp = observed[support], probs[support] / probs[support].sum() * observed.sum()
    stat, dof = float(((obs - exp) ** 2 / exp).sum()), int(support.sum()) - 1
    try:
        from scipy.stats import chi2

        return chi2.sf(stat, dof) > alpha
    except ImportError:
        assert alpha == 1e-3
        return stat < _CHI2_CRIT_1E3[dof]


def params(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seed=0):
    return SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)


def counts(tokens: torch.Tensor, vocab: int) -> np.ndarray:
    return torch.bincount(tokens, minlength=vocab).numpy()




# ---------------------------------------------------------------- rng

_M64 = (1 << 64) - 1
_G = 0x9E3779B97F4A7C15


def _ref_mix(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _ref_uniform(seed: int, pos: int, step: int, stream: int, i: int) -> float:
    """The documented construction in plain unsigned Python integers."""
    k = _ref_mix((seed & _M64) ^ 0x6A09E667F3BCC908)
    for x in (pos, step, stream):
        k = _ref_mix(k + x * _G)
    return ((_ref_mix(k + (i + 1) * _G) >> 41) + 0.5) * 2.0**-23


def test_rng_known_answers_wrapping_int64():
    seeds = [0, 1, -1, -(2**63), 2**63 - 1, 123456789]
    pos = [0, 5, 2**40, 7, 1, 99]
    step = torch.tensor([0, 1, 2, 0, 3, 0])
    u = rng.uniform(torch.tensor(seeds), torch.tensor(pos), step, 2, 64)
    for r in range(len(seeds)):
        for i in (0, 1, 63):
            assert u[r, i].item() == _ref_uniform(seeds[r], pos[r], int(step[r]), 2, i)


def test_rng_range_and_moments():
    r, n = 64, 4096
    u32 = rng.uniform(torch.arange(r) * 7919 - 100, torch.arange(r) % 5, 0, 0, n)
    assert u32.dtype == torch.float32 and u32.shape == (r, n)
    u = u32.double()
    assert 0.0 < u.min().item() and u.max().item() < 1.0
    m, v = u.mean().item(), u.var().item()
    sd_mean, sd_var = (1 / 12 / u.numel()) ** 0.5, ((1 / 80 - 1 / 144) / u.numel()) ** 0.5
    assert abs(m - 0.5) < 5 * sd_mean and abs(v - 1 / 12) < 5 * sd_var
    # Neighbouring columns and neighbouring rows (seeds/positions differing by 1) are uncorrelated.
    c_col = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()
    c_row = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1].item()
    assert abs(c_col) < 0.01 and abs(c_row) < 0.01
    # A histogram over 8 bins is flat.
    assert chi2_consistent(counts((u * 8).long().flatten(), 8), np.ones(8))


def test_rng_keys_are_independent_of_batch_and_each_other():
    seed, pos = torch.tensor([3, 4, 3, 3]), torch.tensor([10, 10, 11, 10])
    u = rng.uniform(seed, pos, 0, 0, 32)
    alone = rng.uniform(seed[2:3], pos[2:3], 0, 0, 32)
    assert torch.equal(u[2], alone[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    # step and stream each change the draw; tensor and int step agree.
    assert not torch.equal(u[3], rng.uniform(seed[3:], pos[3:], 1, 0, 32)[0])
    assert not torch.equal(u[3], rng.uniform(seed[3:], pos[3:], 0, 1, 32)[0])
    assert torch.equal(u, rng.uniform(seed, pos, torch.zeros(4, dtype=torch.int64), 0, 32))
    # A row's first columns do not depend on n.
    assert torch.equal(u[:, :8], rng.uniform(seed, pos, 0, 0, 8))


# ---------------------------------------------------------------- from_params / greedy

def test_from_params_flags_and_seed_wrapping():
    st = SamplingTensors.from_params(
        [params(0.0, seed=2**64 - 1), params(0.7, top_k=5, seed=-3), params(1.0, min_p=None, seed=1)],
        "cpu",
    )
    assert not st.all_greedy and st.any_filter
    assert st.seed.tolist() == [-1, -3, 1] and st.seed.dtype == torch.int64
    assert st.top_k.tolist() == [-1, 5, -1] and st.min_p.tolist() == [0.0, 0.0, 0.0]
    greedy = SamplingTensors.from_params([params(0.0, top_k=3), params(0.0)], "cpu")
    assert greedy.all_greedy
    plain = SamplingTensors.from_params([params(0.0, top_k=3), params(1.0)], "cpu")
    assert not plain.any_filter  # the only filtered row is greedy


def test_greedy_is_argmax_also_in_mixed_batches():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # tie: lowest index wins
    pos = torch.arange(6)
    st = SamplingTensors.from_params([params(0.0, top_k=2)] * 6, "cpu")
    assert torch.equal(sample(logits, st, pos), logits.argmax(-1))
    assert sample(logits, st, pos)[0].item() == 7
    mixed = [params(0.0) if i % 2 == 0 else params(1.0, seed=i) for i in range(6)]
    st = SamplingTensors.from_params(mixed, "cpu")
    out = sample(logits, st, pos)
    assert torch.equal(out[0::2], logits.argmax(-1)[0::2])
    probs = probs_from_logits(logits, st)
    assert torch.equal(probs[0::2], torch.nn.functional.one_hot(logits.argmax(-1)[0::2], 50).float())
    assert torch.allclose(probs.sum(-1), torch.ones(6))


# ---------------------------------------------------------------- filters

def _ref_keep(logits_row: np.ndarray, t: float, top_k: int, top_p: float, min_p: float) -> set:
    """Reference in float64: top-k, then top-p on the renormalised top-k, then min-p."""
    x = logits_row.astype(np.float64) / t
    order = np.argsort(-x, kind="stable")
    keep = list(order if top_k <= 0 else order[:top_k])
    if top_p < 1.0:
        p = np.exp(x[keep] - x[keep].max())
        p /= p.sum()
        cum, kept = 0.0, []
        for tok, pi in zip(keep, p):
            kept.append(tok)
            cum += pi
            if cum >= top_p:
                break
        keep = kept
    if min_p > 0:
        keep = [tok for tok in keep if np.exp(x[tok] - x.max()) >= min_p]
    return set(int(t) for t in keep)


def test_filters_keep_exactly_the_reference_set():
    g = torch.Generator().manual_seed(1)
    rs = np.random.default_rng(1)
    rows, vocab = 64, 40
    logits = torch.randn(rows, vocab, generator=g) * 2.0
    plist = []
    for i in range(rows):
        plist.append(params(
            temperature=float(rs.choice([0.5, 1.0, 1.7])),
            top_k=int(rs.choice([-1, 1, 3, 10, 60])),
            top_p=float(rs.choice([1.0, 0.3, 0.75, 0.95])),
            min_p=float(rs.choice([0.0, 0.05, 0.3])),
            seed=i,
        ))
    st = SamplingTensors.from_params(plist, "cpu")
    probs = probs_from_logits(logits, st)
    masked = filtered_logits(logits, st)
    tokens = torch.stack([sample(logits, st, torch.full((rows,), p)) for p in range(50)], 1)
    for r, p in enumerate(plist):
        ref = _ref_keep(logits[r].numpy(), p.temperature, p.top_k, p.top_p, p.min_p)
        assert set(torch.isfinite(masked[r]).nonzero().flatten().tolist()) == ref, r
        assert set((probs[r] > 0).nonzero().flatten().tolist()) == ref, r
        assert set(tokens[r].tolist()) <= ref
    assert torch.allclose(probs.sum(-1), torch.ones(rows))


def test_disabled_filters_keep_everything_and_3d_logits():
    logits = torch.randn(2, 3, 30, generator=torch.Generator().manual_seed(2))
    st = SamplingTensors.from_params([params(0.8, -1, 1.0, 0.0), params(1.3, 5, 1.0, 0.0)], "cpu")
    probs = probs_from_logits(logits, st)
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 0.8, -1), atol=1e-6)
    assert ((probs[1] > 0).sum(-1) == 5).all()
    for j in range(3):  # the 3-D path equals the 2-D one column by column
        assert torch.equal(probs[:, j], probs_from_logits(logits[:, j], st))


# ---------------------------------------------------------------- determinism and distribution

def test_same_seed_position_same_token_in_any_batch():
    g = torch.Generator().manual_seed(3)
    vocab = 100
    logits = torch.randn(8, vocab, generator=g)
    plist = [params(1.0 + 0.1 * i, top_k=[-1, 20][i % 2], top_p=[1.0, 0.9][i % 3 == 0], seed=100 + i)
             for i in range(8)]
    pos = torch.arange(8) * 3 + 11
    batch = sample(logits, SamplingTensors.from_params(plist, "cpu"), pos)
    perm = torch.randperm(8, generator=g)
    shuffled = sample(logits[perm], SamplingTensors.from_params([plist[i] for i in perm], "cpu"),
                      pos[perm])
    assert torch.equal(shuffled, batch[perm])
    for i in range(8):
        alone = sample(logits[i:i + 1], SamplingTensors.from_params([plist[i]], "cpu"), pos[i:i + 1])
        assert alone.item() == batch[i].item()


def test_different_positions_and_seeds_give_different_draws():
    logits = torch.zeros(200, 1000)  # uniform over 1000 tokens
    st = SamplingTensors.from_params([params(1.0, seed=5)] * 200, "cpu")
    by_pos = sample(logits, st, torch.arange(200))
    assert len(set(by_pos.tolist())) > 150
    st2 = SamplingTensors.from_params([params(1.0, seed=s) for s in range(200)], "cpu")
    by_seed = sample(logits, st2, torch.zeros(200, dtype=torch.int64))
    assert len(set(by_seed.tolist())) > 150
    assert (by_pos != sample(logits, st2, torch.arange(200))).sum() > 150


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, -1, 1.0, 0.0), (0.6, -1, 1.0, 0.0), (1.5, 4, 1.0, 0.0), (1.0, -1, 0.8, 0.0),
     (1.0, -1, 1.0, 0.2)],
)
def test_empirical_distribution_matches_probs(temperature, top_k, top_p, min_p):
    n, vocab = 20000, 7
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 0.7])
    expected = probs_from_logits(
        logits[None], SamplingTensors.from_params([params(temperature, top_k, top_p, min_p)], "cpu")
    )[0]
    if (top_k, top_p, min_p) == (-1, 1.0, 0.0):
        assert torch.allclose(expected, torch.softmax(logits / temperature, -1))
    # Half the draws vary the position under one seed, half vary the seed at one position.
    plist = [params(temperature, top_k, top_p, min_p, seed=7 if i < n // 2 else i) for i in range(n)]
    pos = torch.where(torch.arange(n) < n // 2, torch.arange(n), torch.full((n,), 3))
    tokens = sample(logits.expand(n, vocab), SamplingTensors.from_params(plist, "cpu"), pos)
    assert chi2_consistent(counts(tokens, vocab), expected.numpy())


# ---------------------------------------------------------------- no host sync, devices

def test_sample_and_probs_do_not_sync():
    logits = torch.randn(4, 32)
    st = SamplingTensors.from_params(
        [params(0.0), params(1.0, 5, 0.9, 0.1, seed=1), params(0.5, seed=2), params(1.0, seed=3)], "cpu"
    )
    pos = torch.arange(4)
    with NoHostSync():
        sample(logits, st, pos)
        probs_from_logits(logits, st)
        rng.uniform(st.seed, pos, torch.ones(4, dtype=torch.int64), 1, 8)
    with pytest.raises(AssertionError):
        with NoHostSync():
            logits.sum().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_bit_for_bit():
    seed = torch.tensor([0, -1, 2**62, 12345, -(2**63)])
    pos = torch.tensor([0, 1, 2**33, 77, 5])
    u_cpu = rng.uniform(seed, pos, 3, 1, 5000)
    u_gpu = rng.uniform(seed.cuda(), pos.cuda(), 3, 1, 5000)
    assert torch.equal(u_cpu, u_gpu.cpu())
    logits = torch.randn(5, 5000, generator=torch.Generator().manual_seed(0)) * 3
    plist = [params(0.9, seed=s) for s in seed.tolist()]
    tok_cpu = sample(logits, SamplingTensors.from_params(plist, "cpu"), pos)
    tok_gpu = sample(logits.cuda(), SamplingTensors.from_params(plist, "cuda"), pos.cuda())
    assert torch.equal(tok_cpu, tok_gpu.cpu())
