"""Log-probabilities of sampled tokens (``SamplingParams.logprobs``), computed on the device in the
step and carried home in the step's one D2H payload.

The distribution is ``log_softmax`` of the target's logits *after the request's logits
processing* (penalties, bias, bad words, min_tokens: sampling/logits_processing.py) and before
temperature and the top-k / top-p / min-p filters: the model's distribution as the request shaped
it, the same whatever the temperature. A verify row's position j is the distribution given the
drafts before j (the accepted prefix), so under speculative decoding every emitted token gets the
logprobs decoding without spec would give it.

Payload layout: per step row, per token column c in [0, 1+K): ``1 + 2N`` float64 values
``[logprob of the sampled token, top-N logprobs (descending), top-N token ids]``, viewed as int64
and appended after the token columns (N = the largest ``logprobs`` of the step's sampling rows;
every row gets N, the commit keeps each request's own number). Rows or columns that sampled
nothing hold garbage the host never reads (their token is -1).
"""
from __future__ import annotations

import numpy as np
import torch


def logprobs_block(logits: torch.Tensor, sampled: torch.Tensor, sample_rows_p: torch.Tensor, num_decode: int,
                   n: int) -> torch.Tensor:
    """logits [L, V] (processed; rows as the sampler's: N_d*(1+K) verify rows, then one per
    sampling prefill row); sampled [B, 1+K] -> int64 [B, (1+K) * (1 + 2n)] (float64 bits)."""
    num_rows, k1 = sampled.shape
    lp = torch.log_softmax(logits.float(), dim=-1)                                    # [L, V]
    tok = torch.cat([sampled[:num_decode].reshape(-1), sampled[sample_rows_p, 0]]).clamp(min=0)   # [L]
    vals = [lp.gather(1, tok[:, None])]                                               # [L, 1]
    if n:
        top = lp.topk(n, dim=-1)
        vals += [top.values, top.indices.to(lp.dtype)]                                # ids < 2**24: exact
    per_tok = torch.cat(vals, 1).to(torch.float64)                                    # [L, 1+2n]
    width = 1 + 2 * n
    out = torch.zeros(num_rows, k1, width, dtype=torch.float64, device=logits.device)
    out[:num_decode] = per_tok[:num_decode * k1].view(num_decode, k1, width)
    out[sample_rows_p, 0] = per_tok[num_decode * k1:]
    return out.view(num_rows, k1 * width).view(torch.int64)


def unpack(extra: np.ndarray, tokens_per_row: int) -> np.ndarray:
    """The host side: int64 [B, (1+K)(1+2n)] -> float64 [B, 1+K, 1+2n]."""
    num_rows = extra.shape[0]
    return np.ascontiguousarray(extra).view(np.float64).reshape(num_rows, tokens_per_row, -1)


def entry(values: np.ndarray, token: int, n: int) -> dict[int, float]:
    """One token's logprobs as ``{token id: logprob}``: the sampled token first, then the top n
    (a top token equal to the sampled one appears once). values [1 + 2N] from ``unpack``."""
    width = (len(values) - 1) // 2
    d = {int(token): float(values[0])}
    for i in range(n):
        d.setdefault(int(values[1 + width + i]), float(values[1 + i]))
    return d
