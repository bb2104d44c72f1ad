"""Batched token sampling: greedy, temperature, top-k, top-p, min-p, Gumbel-max with keyed noise.

Everything here stays on the device: no ``.item()``, ``.tolist()``, ``.cpu()``, ``nonzero()`` or
boolean-mask indexing. Mixed greedy/random batches are handled per row with ``torch.where``; the
host flags in ``SamplingTensors`` (``all_greedy``, ``any_filter``) are computed from the Python
parameters in ``from_params``, never read back from the device.

Randomness: the noise of row r is ``rng.gumbel`` keyed (seed[r], positions[r], step=0, stream=0),
one value per vocab index, so a seeded request samples the same token whatever batch it is in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hybrid_engine.sampling import rng


@dataclass
class SamplingTensors:
    """Per-row sampling parameters, all of length R (rows of the logits)."""

    temperature: torch.Tensor  # [R] f32, 0 = greedy
    top_k: torch.Tensor  # [R] int64, <= 0 (canonically -1) = off
    top_p: torch.Tensor  # [R] f32, >= 1.0 = off
    min_p: torch.Tensor  # [R] f32, 0 = off
    seed: torch.Tensor  # [R] int64
    all_greedy: bool  # host flag: every row has temperature 0 (argmax fast path)
    any_filter: bool = True  # host flag: some random row uses top-k/top-p/min-p (else skip the sort)

    @classmethod
    def from_params(cls, params: Sequence, device: torch.device | str) -> "SamplingTensors":
        """Build from objects with temperature, top_k, top_p, min_p (None = 0) and an int seed."""
        temps = [float(p.temperature) for p in params]
        top_k = [int(p.top_k) if p.top_k is not None else -1 for p in params]
        top_p = [float(p.top_p) if p.top_p is not None else 1.0 for p in params]
        min_p = [float(getattr(p, "min_p", 0.0) or 0.0) for p in params]
        seeds = [rng.to_int64_seed(p.seed) for p in params]
        random_rows = [i for i, t in enumerate(temps) if t > 0.0]
        any_filter = any(top_k[i] > 0 or top_p[i] < 1.0 or min_p[i] > 0.0 for i in random_rows)
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            seed=torch.tensor(seeds, dtype=torch.int64, device=device),
            all_greedy=not random_rows,
            any_filter=any_filter,
        )


def _rows(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-row [R] tensor shaped to broadcast against an [R, ..., V] tensor of ``ndim`` dims."""
    return x.view(x.shape[0], *([1] * (ndim - 1)))


def filtered_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits[R, ..., V] / temperature with top-k, top-p, min-p applied (removed tokens = -inf).

    Greedy rows are scaled by 1 (their result is not meaningful; callers take the argmax path).
    The three filters each keep a prefix of the tokens sorted by logit, so one sort and one
    threshold per row suffice; tokens tied with the threshold logit are all kept.
    top-p is measured on the top-k-renormalised distribution, min-p relative to the top token.
    """
    ndim = logits.dim()
    temp = torch.where(st.temperature > 0, st.temperature, torch.ones_like(st.temperature))
    x = logits.float() / _rows(temp, ndim)
    if not st.any_filter:
        return x
    vocab = x.shape[-1]
    srt = torch.sort(x, dim=-1, descending=True).values
    rank = torch.arange(vocab, device=x.device)
    k = torch.where(st.top_k > 0, st.top_k.clamp(max=vocab), torch.full_like(st.top_k, vocab))
    in_k = rank < _rows(k, ndim)
    probs = torch.softmax(srt.masked_fill(~in_k, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    top_p = _rows(st.top_p, ndim)
    in_p = (mass_before < top_p) | (top_p >= 1.0)
    in_min_p = srt >= srt[..., :1] + torch.log(_rows(st.min_p, ndim))
    n_keep = (in_k & in_p & in_min_p).sum(-1, keepdim=True).clamp(min=1)
    threshold = srt.gather(-1, n_keep - 1)
    return x.masked_fill(x < threshold, float("-inf"))


def probs_from_logits(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """probs[R, ..., V] f32 of the filtered, tempered distribution; greedy rows are one-hot argmax."""
    greedy = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float32)
    if st.all_greedy:
        return greedy
    probs = torch.softmax(filtered_logits(logits, st), dim=-1)
    return torch.where(_rows(st.temperature, logits.dim()) > 0, probs, greedy)


def nonfinite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[R] bool: rows of logits[R, V] whose maximum is not finite -- a NaN (max propagates it) or a
    +inf anywhere, or no finite value at all. Such a row defines no distribution: whatever token
    argmax/Gumbel-max picks from it is meaningless. One reduction, no sync."""
    return ~torch.isfinite(logits.amax(-1))


def gumbel_argmax(
    scores: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor, stream=0
) -> torch.Tensor:
    """argmax(scores[R, V] + Gumbel noise keyed (seed, position, step=0, stream)) -> [R] int64.

    With scores = log-probabilities up to a per-row constant (e.g. filtered logits / T, or
    log of unnormalised probabilities) this is an exact sample from softmax(scores).
    """
    noise = rng.gumbel(seed, positions, 0, stream, scores.shape[-1])
    return torch.argmax(scores + noise, dim=-1)


def sample(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor) -> torch.Tensor:
    """tokens[R] int64 from logits[R, V]: argmax for temperature-0 rows, else a keyed sample.

    positions[R] is the absolute position of the token being sampled (the noise key).
    """
    greedy = logits.argmax(-1)
    if st.all_greedy:
        return greedy
    drawn = gumbel_argmax(filtered_logits(logits, st), st.seed, positions, 0)
    return torch.where(st.temperature > 0, drawn, greedy)

