"""The sample/verify phase of a step: logits -> sampled [B, 1+K] int64, -1 where nothing was kept.

Chosen once per engine: ``TokenSampler`` without speculation, ``DraftVerifier`` (rejection
sampling of the decode rows' drafts; the step's K, 0..num_speculative_tokens, is the drafts' width)
with it. Decode rows fill rows [:N_d]; prefill rows that
sample write column 0 of their row; every other entry is -1 (docs/design.md invariant 7: the
valid tokens of a row are a prefix, so num_valid = (sampled != -1).sum(1))."""
from __future__ import annotations

import torch

from hybrid_engine.spec.rejection import forced_accept, rejection_sample

from ..sampling.sampler import sample
from .step_io import StepInputs


class TokenSampler:
    """K = 0: one token per decode row and per sampling prefill row."""

    def sample(self, logits: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """logits [L, V] float32 at the step's logits indices -> sampled [B, 1]."""
        num_decode, num_prefill = inp.num_decode, inp.num_prefill
        decoded = None
        if num_decode:
            # position of the produced token (the noise key; greedy rows never read it)
            pos = None if inp.sampling_decode.all_greedy else (inp.start[:num_decode] if num_prefill else inp.start) + 1
            if pos is None and not num_prefill:       # all greedy, decode only: one op
                return logits.argmax(-1, keepdim=True)
            decoded = sample(logits[:num_decode] if num_prefill else logits, inp.sampling_decode, pos)[:, None]
            if not num_prefill:
                return decoded
        return _with_prefill_rows(logits, inp, decoded, 1)


class DraftVerifier:
    """A spec engine: decode rows verify their drafts (greedy or probabilistic rejection,
    lossless). K is the step's width, ``inp.spec.drafts.shape[1]`` (adaptive speculation: 0..K;
    K = 0 is a plain decode step through the same path).

    ``forced_acceptance_rate`` (benchmark only): each draft is accepted with that probability
    whatever the target says (``spec.rejection.forced_accept``); outputs are not the model's."""

    def __init__(self, num_spec: int, forced_acceptance_rate: float | None = None):
        self.num_spec = num_spec
        self.forced = forced_acceptance_rate
        self._plain = TokenSampler()

    def sample(self, logits: torch.Tensor, inp: StepInputs) -> torch.Tensor:
        """logits [L, V] float32 -> sampled [B, 1+K]."""
        num_decode, num_prefill = inp.num_decode, inp.num_prefill
        tokens_per_row = 1 + inp.spec.drafts.shape[1]
        if tokens_per_row == 1:
            # no drafts this step: verifying none is plain sampling (a -1 draft's column is filled
            # exactly as the sampler would, spec/rejection.py), so take the sampler's short path
            return self._plain.sample(logits, inp)
        verified = None
        if num_decode:
            start = inp.start[:num_decode] if num_prefill else inp.start
            decode_logits = logits[:num_decode * tokens_per_row].view(num_decode, tokens_per_row, -1)
            if self.forced is not None:
                verified = forced_accept(decode_logits, inp.spec.drafts, self.forced,
                                         inp.slots[:num_decode], start + 1)
            else:
                pos = None if inp.sampling_decode.all_greedy else start + 1
                verified = rejection_sample(decode_logits, inp.spec.drafts, inp.spec.draft_probs,
                                            inp.sampling_decode, pos)
            if not num_prefill:
                return verified
        return _with_prefill_rows(logits, inp, verified, tokens_per_row)


def _with_prefill_rows(logits: torch.Tensor, inp: StepInputs, decoded: torch.Tensor | None,
                       tokens_per_row: int) -> torch.Tensor:
    """[B, 1+K] -1-filled; decode rows' results in [:N_d]; sampling prefill rows in column 0."""
    num_decode = inp.num_decode
    out = torch.full((num_decode + inp.num_prefill, tokens_per_row), -1, dtype=torch.int64, device=logits.device)
    if num_decode:
        out[:num_decode] = decoded
    if inp.sampling_prefill is not None:
        out[inp.sample_rows_p, 0] = sample(logits[num_decode * tokens_per_row:], inp.sampling_prefill,
                                           inp.sample_pos_p)
    return out
