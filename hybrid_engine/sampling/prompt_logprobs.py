"""Prompt logprobs (``SamplingParams.prompt_logprobs``): for every prompt token after the first,
its log-probability given the tokens before it, and the top-N alternatives -- what evaluation
harnesses read for loglikelihood.

The distribution is ``log_softmax`` of the target's raw logits (no penalties or bias: they shape
outputs, not the prompt). Computed in the step that prefills the tokens, chunk by chunk (chunked
prefill needs nothing special: a chunk covering positions [s, s+n) scores prompt tokens s+1 ..
s+n), from the step's final hidden states through the lm_head, a few hundred rows at a time so
a long chunk never holds [n, V] logits at once. The targets are the step's own ``next_input_ids``
(the next token of each prefill token, host-known and already on the device). Values travel in a
separate D2H copy (``PromptLogprobsCopy``) made only by steps that carry such a request; its
host side lands in ``ModelRunnerOutput.prompt_logprobs`` and the commit files them by position,
so a chunk recomputed after a preemption overwrites equal values.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_ROWS_PER_PASS = 512      # lm_head rows at a time: [512, V] float32 logits at most


@dataclass(frozen=True)
class PromptSpan:
    """Prompt tokens scored by one step row: positions start .. start+count-1 of the request."""
    req_id: str
    epoch: int
    start: int               # first scored prompt position (>= 1)
    count: int


class PromptLogprobsCopy:
    """One step's prompt logprobs on their way to the host."""

    def __init__(self, copy, spans: list[PromptSpan], width: int):
        self._copy, self.spans, self.width = copy, spans, width

    def read(self) -> list[tuple[PromptSpan, np.ndarray]]:
        """[(span, float64 [count, 1+2N])] (waits for the copy)."""
        values = self._copy.wait().view(np.float64).reshape(-1, self.width)
        out, i = [], 0
        for s in self.spans:
            out.append((s, values[i:i + s.count]))
            i += s.count
        return out


def prompt_logprobs_block(compute_logits, hidden: torch.Tensor, next_ids: torch.Tensor,
                          rows: list[tuple[int, int]], n: int) -> torch.Tensor:
    """int64 [sum(count), 1+2n] (float64 bits): per scored token [its logprob, top-n logprobs, top-n
    ids]. rows: (offset of the first token in hidden / next_ids, count), host ints."""
    parts = []
    for off, count in rows:
        for a in range(off, off + count, _ROWS_PER_PASS):
            b = min(a + _ROWS_PER_PASS, off + count)
            lp = torch.log_softmax(compute_logits(hidden[a:b]).float(), dim=-1)        # [r, V]
            vals = [lp.gather(1, next_ids[a:b, None].clamp(min=0))]
            if n:
                top = lp.topk(n, dim=-1)
                vals += [top.values, top.indices.to(lp.dtype)]
            parts.append(torch.cat(vals, 1).to(torch.float64))
    return torch.cat(parts).view(torch.int64)
