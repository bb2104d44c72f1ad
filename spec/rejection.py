"""Rejection sampling of K drafts against the target's 1 + K logit rows (lossless).

Greedy rows (temperature 0) accept draft j while it equals argmax(target[j]); the first mismatch
writes that argmax; if all K are accepted the bonus argmax(target[K]) follows.

Random rows with one-hot drafts (``draft_probs`` None, e.g. n-gram) use sample-and-compare (see
``_sample_and_compare``): the same law as below, and the same tokens as decoding without spec.
Random rows with draft probabilities follow Leviathan et al. (2023): with p = the target's
filtered distribution and q the draft distribution, draft d_j is accepted if
u_j * q(d_j) < p(d_j) (that is, u_j < p/q; q(d_j) = 0 accepts iff p(d_j) > 0). At the first
rejection a token is drawn from normalise(max(p - q, 0)) (from p if that is all zero); after K
acceptances the bonus is drawn from p[K]. Keys (seed, absolute position, step=0, stream):
acceptance u stream 1, residual stream 2, bonus stream 0 -- the bonus is bit-identical to
``sampler.sample`` at that position. A draft of -1 ("no draft") is always rejected and its column
is filled exactly as the plain sampler would (target argmax, or a stream-0 sample from p), so a
request without drafts produces the same tokens as one decoded without speculation.

Vectorised: acceptance is a cumulative product over K; the correction/bonus is computed only at
the one column per row where the accepted prefix ends. No host synchronisation.
"""

from __future__ import annotations

import torch

from hybrid_engine.sampling.sampler import SamplingTensors, filtered_logits, gumbel_argmax
from hybrid_engine.sampling import rng

# FORCED_STREAM is read by the fused verification kernel too (triton_greedy_verify)
_ACCEPT_STREAM, _RESIDUAL_STREAM, _SAMPLE_STREAM, FORCED_STREAM = 1, 2, 0, 3


def _gather_col(x: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """x[r, col[r], :] for x[R, C, V] and col[R] -> [R, V]."""
    idx = col.view(-1, 1, 1).expand(-1, 1, x.shape[-1])
    return x.gather(1, idx).squeeze(1)


def rejection_sample(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    st: SamplingTensors,
    positions: torch.Tensor,
) -> torch.Tensor:
    """output[R, 1 + K] int64: accepted drafts, then the correction or bonus, then -1.

    target_logits[R, 1+K, V] f32; draft_tokens[R, K] int64 (-1 = no draft); draft_probs[R, K, V]
    f32 or None; positions[R] = absolute position of the token produced at output column 0.
    """
    num_rows, k1, _ = target_logits.shape
    k = k1 - 1
    assert draft_tokens.shape == (num_rows, k), (draft_tokens.shape, target_logits.shape)
    if st.all_greedy:
        return _greedy(target_logits, draft_tokens)
    dev = target_logits.device
    positions = positions.to(torch.int64)
    cols = torch.arange(k1, device=dev)

    valid = draft_tokens >= 0  # [R, K]
    drafts = draft_tokens.clamp(min=0)
    target_argmax = target_logits.argmax(-1)  # [R, 1+K]
    accept = valid & (drafts == target_argmax[:, :k])

    random_rows = st.temperature > 0
    if draft_probs is None:
        return _sample_and_compare(target_logits, drafts, valid, accept, target_argmax, st, positions)
    scaled = filtered_logits(target_logits, st)  # [R, 1+K, V]
    if k > 0:
        p_d = torch.softmax(scaled[:, :k], dim=-1).gather(-1, drafts[..., None]).squeeze(-1)
        q_d = draft_probs.float().gather(-1, drafts[..., None]).squeeze(-1)
        u_pos = (positions[:, None] + cols[:k]).reshape(-1)
        u_seed = st.seed.repeat_interleave(k)
        u = rng.uniform(u_seed, u_pos, 0, _ACCEPT_STREAM, 1).view(num_rows, k)
        accept = torch.where(random_rows[:, None], valid & (u * q_d < p_d), accept)

    # Accepted drafts = length of the all-accepted prefix; that column gets the one new token.
    num_acc = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R] in [0, K]
    fill = target_argmax.gather(1, num_acc[:, None]).squeeze(1)
    # The one column per row that needs a token: residual draw after rejecting a real draft,
    # else (bonus, or a -1 draft) exactly the plain sampler's draw from p.
    scores = _gather_col(scaled, num_acc)  # [R, V]
    valid_pad = torch.cat([valid, valid.new_zeros(num_rows, 1)], dim=1)
    residual_row = valid_pad.gather(1, num_acc[:, None]).squeeze(1)
    if k > 0:
        p_c = torch.softmax(scores, dim=-1)
        col_q = num_acc.clamp(max=k - 1)
        q_c = _gather_col(draft_probs.float(), col_q)
        residual = (p_c - q_c).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_c)
        scores = torch.where(residual_row[:, None], torch.log(residual), scores)
    stream = torch.where(residual_row, _RESIDUAL_STREAM, _SAMPLE_STREAM)
    drawn = gumbel_argmax(scores, st.seed, positions + num_acc, stream)
    fill = torch.where(random_rows, drawn, fill)

    return _assemble(drafts, num_acc, fill)


def _greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """All rows greedy (host flag): the general path's result in ~8 device ops instead of ~25.

    An accepted draft equals the target argmax at its column and the fill is the argmax at the
    first rejected column (or the bonus), so the output is simply the target argmax up to and
    including column num_acc, then -1. A -1 draft never equals an argmax (>= 0): it is rejected
    without a separate validity mask."""
    k = draft_tokens.shape[1]
    target_argmax = target_logits.argmax(-1)                                   # [R, 1+K]
    accept = draft_tokens == target_argmax[:, :k]                              # [R, K]
    num_acc = accept.cumprod(dim=1).sum(dim=1, keepdim=True)                   # [R, 1] in [0, K]
    cols = torch.arange(k + 1, device=target_logits.device)
    return target_argmax.masked_fill(cols > num_acc, -1)


def _assemble(drafts: torch.Tensor, num_acc: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    num_rows, k = drafts.shape
    cols = torch.arange(k + 1, device=drafts.device)
    drafts_pad = torch.cat([drafts, drafts.new_zeros(num_rows, 1)], dim=1)
    n = num_acc[:, None]
    return torch.where(cols < n, drafts_pad, torch.where(cols == n, fill[:, None], torch.full_like(drafts_pad, -1)))


def _sample_and_compare(target_logits, drafts, valid, greedy_accept, target_argmax, st, positions):
    """One-hot drafts (no draft probabilities, e.g. n-gram): draw the plain sampler's token at every
    position (keys (seed, position, stream 0), bit-identical to ``sampler.sample``) and accept a
    draft iff it equals that draw; the first mismatch emits the draw. A draft d is then accepted
    with probability p(d) and a rejection yields p conditioned on != d: the law of min(1, p/q) with
    one-hot q, and every emitted token equals the no-spec token for the same seed."""
    num_rows, k1, vocab = target_logits.shape
    k = k1 - 1
    cols = torch.arange(k1, device=target_logits.device)
    scaled = filtered_logits(target_logits, st)                                  # [R, 1+K, V]
    seeds = st.seed.repeat_interleave(k1)
    pos = (positions[:, None] + cols).reshape(-1)
    plain = gumbel_argmax(scaled.reshape(-1, vocab), seeds, pos, _SAMPLE_STREAM).view(num_rows, k1)
    random_rows = (st.temperature > 0)[:, None]
    plain = torch.where(random_rows, plain, target_argmax)
    accept = torch.where(random_rows, valid & (drafts == plain[:, :k]), greedy_accept)
    num_acc = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return _assemble(drafts, num_acc, plain.gather(1, num_acc[:, None]).squeeze(1))


def forced_accept(target_logits: torch.Tensor, draft_tokens: torch.Tensor, rate: float,
                  row_keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """BENCHMARK ONLY (``SpeculativeConfig.forced_acceptance_rate``): output[R, 1+K] as if each
    draft were accepted with probability ``rate``, independently, whatever the target says.

    Draft j of row r is accepted iff u(row_keys[r], positions[r] + j, stream 3) < rate and every
    draft before it was; an accepted column emits the draft (the target's argmax where the row had
    no draft, so the emitted ids stay real tokens) and the column after the accepted prefix emits
    the target's argmax. The cost of the step (forward, verification, the drafter following the
    accepted tokens) is that of a real step with this acceptance; the tokens are not the model's.
    row_keys[R] int64 (the rows' slots: rows at the same position draw differently), positions[R]
    the position of the token produced at column 0. No host synchronisation."""
    k = target_logits.shape[1] - 1
    if k == 0:
        return target_logits.argmax(-1)
    return forced_output(target_logits, draft_tokens, forced_accept_mask(rate, row_keys, positions, k))


def forced_output(target_logits: torch.Tensor, draft_tokens: torch.Tensor, accept: torch.Tensor) -> torch.Tensor:
    """``forced_accept``'s output[R, 1+K] from its coins accept[R, K] (bool): the drafts of the
    prefix of passed coins, then the target's argmax, then -1."""
    k = draft_tokens.shape[1]
    target_argmax = target_logits.argmax(-1)                                   # [R, 1+K]
    cols = torch.arange(k + 1, device=target_logits.device)
    num_acc = accept.to(torch.int64).cumprod(dim=1).sum(dim=1, keepdim=True)   # [R, 1]
    emitted = torch.where(draft_tokens >= 0, draft_tokens, target_argmax[:, :k])     # [R, K]
    emitted = torch.cat([emitted, target_argmax[:, k:]], dim=1)                      # [R, 1+K]
    out = torch.where(cols < num_acc, emitted, target_argmax)
    return out.masked_fill(cols > num_acc, -1)


def forced_accept_mask(rate: float, row_keys: torch.Tensor, positions: torch.Tensor, k: int) -> torch.Tensor:
    """BENCHMARK ONLY: [R, k] bool, draft j of row r passes its coin (u < rate, u keyed by
    (row_keys[r], positions[r] + j, stream 3)); ``forced_accept`` accepts the prefix of passes. The
    fused verify-step graphs draw the same coins in their verification kernel
    (``triton_greedy_verify.greedy_verify(forced_rate=, forced_keys=)``), so forced steps emit the
    same tokens on either path. The coins are a function of (key, position): requests that reuse a
    slot over the same positions draw the same coins (a batch-1 benchmark gives its prompts disjoint
    position ranges). No host synchronisation."""
    num_rows = row_keys.shape[0]
    cols = torch.arange(k, device=row_keys.device)
    u = rng.uniform(row_keys.to(torch.int64).repeat_interleave(k),
                    (positions.to(torch.int64)[:, None] + cols).reshape(-1), 0, FORCED_STREAM, 1)
    return u.view(num_rows, k) < rate


def num_accepted(output: torch.Tensor) -> torch.Tensor:
    """Valid tokens per row of a rejection output (a contiguous prefix): >= 1 for sampled rows."""
    return (output != -1).sum(dim=1)
