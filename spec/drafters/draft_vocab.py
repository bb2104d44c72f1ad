"""A reduced draft vocabulary for the MTP drafter (``SpeculativeConfig.draft_vocab_size``).

Each MTP draft token multiplies the drafter's hidden state by the target's whole lm_head: on a
131072-row vocabulary that is most of the bytes an MTP proposal reads. ``DraftVocabHead`` scores
only the first ``rows`` rows (views of the lm_head's tensors, no copy) and returns logits over the
full vocabulary with -inf beyond them, so the drafters' sampling and draft probabilities work
unchanged: draft tokens are ids below ``rows`` and their probabilities are zero above. Target
verification reads the full head, so the outputs are those of the full vocabulary (greedy: the
same tokens; sampled: the same distribution, rejection sampling being exact for any draft
distribution). The price is acceptance on tokens beyond ``rows``.

With ``SpeculativeConfig.quantization`` the head scores those rows with an FP8 copy of them on
few-row steps (``draft_quant.draft_head``), for the same reason: fewer bytes a draft token.
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def head_rows(head: nn.Module, rows: int) -> nn.Module:
    """A module computing ``head``'s first ``rows`` outputs: a shallow copy whose per-output-row
    tensors (weight, bias, per-channel or per-block scales: first dim == out_features) are views of
    their first ``rows`` rows; per-tensor scales are shared as they are. Views of the tensors the
    head holds now: the drafter is built after loading and quantization, and nothing replaces the
    lm_head's tensors later (a reload would need a new drafter)."""
    out = getattr(head, "out_features", None)
    if out is None or not hasattr(head, "weight"):
        raise TypeError(f"draft_vocab_size: the lm_head ({type(head).__name__}) has no per-row weight to take rows of")
    sub = copy.copy(head)
    sub._parameters = dict(head._parameters)
    sub._buffers = dict(head._buffers)
    for name, t in head._parameters.items():
        if t is not None and t.dim() >= 1 and t.shape[0] == out:
            sub._parameters[name] = nn.Parameter(t[:rows], requires_grad=False)     # a view
    for name, t in head._buffers.items():
        if t is not None and t.dim() >= 1 and t.shape[0] == out:
            sub._buffers[name] = t[:rows]
    sub.out_features = rows
    return sub


class DraftVocabHead:
    """``compute_logits`` of ``target`` over its first ``rows`` vocabulary rows -> [L, V] float32,
    -inf beyond ``rows``; ``quantization`` ("fp8"): through a quantized copy of those rows."""

    def __init__(self, target, rows: int, quantization: str | None = None):
        self.target, self.rows, self.vocab = target, rows, target.cfg.vocab_size
        self.head = head_rows(target.lm_head, rows)
        if quantization is not None:
            from .draft_quant import draft_head
            self.head = draft_head(self.head)

    def argmax(self, normed: torch.Tensor) -> torch.Tensor:
        """[L] the greedy draft ids: the argmax over the first rows, with no full-width logits (the
        -inf columns never win; ties and NaN rows resolve as on the padded logits)."""
        return self.target.compute_logits(normed, self.head).argmax(-1)

    def __call__(self, normed: torch.Tensor) -> torch.Tensor:
        part = self.target.compute_logits(normed, self.head)                        # [L, rows]
        if self.rows == self.vocab:
            return part
        logits = part.new_full((part.shape[0], self.vocab), float("-inf"))
        logits[:, :self.rows] = part
        return logits
