"""Per-request logits processing on the device: logit_bias, bad_words, min_tokens and the
repetition / frequency / presence penalties (docs/design.md, "Logits processing").

A request's processed logits at a sampled position, given its output tokens so far (``out``, with
``counts[v]`` = occurrences of v in ``out``) and its prompt:

    x = logits + bias                                     # logit_bias, dense per request
    x[w_last] = -inf  for each bad word w whose first len(w)-1 tokens end ``out``
    x[s] = -inf       for each stop id s (EOS too unless ignore_eos) while len(out) < min_tokens
    x = where(v in prompt or counts[v] > 0, where(x > 0, x / r, x * r), x)     # repetition r
    x = x - frequency * counts - presence * (counts > 0)

Everything the sampler does afterwards (temperature, top-k/p, min-p, Gumbel-max, rejection)
sees x. Under speculative decoding the K + 1 logit rows of a verify row are processed position
by position: at draft position j, ``out`` is the committed outputs followed by the first j drafts
(what ``out`` is if those drafts are accepted), so the greedy verifier accepts exactly what
decoding without spec emits and the rejection sampler compares against the processed target
distribution at every position (lossless).

State lives on the device, indexed by Mamba slot (a request's stable index while it runs):
parameters ``[S]``, bias ``[S, V]``, the min-tokens ban mask ``[S, V]``, prompt membership
``[S, V]``, output counts ``[S, V+1]`` (column V absorbs the -1 pads), the output count ``[S]``,
the last ``H`` output tokens ``[S, H]`` (bad-word prefixes) and the bad words ``[S, W, L]``. It
is allocated when the first request that needs it arrives (an engine whose requests never use
these features allocates and runs nothing), written when a request enters the batch (``add``,
off the step path) and advanced after each step's sampling from the sampled tokens (``record``,
device ops only). Rows are gathered by slot on the device: no host sync.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_BAD_WORD_TOKENS = 8            # L: longest bad word, in tokens
MAX_BAD_WORDS = 64                 # W: bad-word token sequences per request (spellings included)
_HISTORY = MAX_BAD_WORD_TOKENS - 1  # H: output tokens a bad-word prefix can span


@dataclass(frozen=True)
class ProcessingSpec:
    """What one request's processing needs, in token ids (built by ``EngineCore.make_request``;
    None for a request that needs none)."""
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    min_tokens_banned: tuple[int, ...]        # stop ids (and EOS unless ignore_eos)
    bias: tuple[tuple[int, float], ...]       # (token id, bias)
    bad_words: tuple[tuple[int, ...], ...]    # token sequences, 1..MAX_BAD_WORD_TOKENS each

    @classmethod
    def of(cls, params, eos_token_ids: tuple[int, ...], bad_word_ids) -> "ProcessingSpec | None":
        banned = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_token_ids))
        spec = cls(presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
                   repetition_penalty=params.repetition_penalty,
                   min_tokens=params.min_tokens if banned else 0, min_tokens_banned=banned,
                   bias=tuple(params.logit_bias), bad_words=tuple(tuple(w) for w in bad_word_ids))
        needed = (spec.presence_penalty != 0 or spec.frequency_penalty != 0 or spec.repetition_penalty != 1
                  or spec.min_tokens > 0 or spec.bias or spec.bad_words)
        return spec if needed else None


class LogitsProcessor:
    """The device state above and the two step hooks, ``apply`` and ``record`` (owned by the runner)."""

    def __init__(self, num_slots: int, vocab_size: int, num_spec: int, device: torch.device):
        self.num_slots, self.vocab, self.num_spec, self.device = num_slots, vocab_size, num_spec, device
        self.allocated = False

    def _allocate(self) -> None:
        s, v, dev = self.num_slots, self.vocab, self.device
        self.presence = torch.zeros(s, dtype=torch.float32, device=dev)             # [S]
        self.frequency = torch.zeros(s, dtype=torch.float32, device=dev)            # [S]
        self.repetition = torch.ones(s, dtype=torch.float32, device=dev)            # [S]
        self.min_tokens = torch.zeros(s, dtype=torch.int64, device=dev)             # [S]
        self.num_out = torch.zeros(s, dtype=torch.int64, device=dev)                # [S] outputs so far
        self.bias = torch.zeros(s, v, dtype=torch.float32, device=dev)              # [S, V]
        self.min_ban = torch.zeros(s, v, dtype=torch.bool, device=dev)              # [S, V]
        self.in_prompt = torch.zeros(s, v, dtype=torch.bool, device=dev)            # [S, V]
        self.counts = torch.zeros(s, v + 1, dtype=torch.int32, device=dev)          # [S, V+1]
        self.history = torch.full((s, _HISTORY), -1, dtype=torch.int64, device=dev)  # [S, H] last outputs
        self.words = torch.full((s, MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -2, dtype=torch.int64, device=dev)
        self.word_len = torch.zeros(s, MAX_BAD_WORDS, dtype=torch.int64, device=dev)  # [S, W] 0 = no word
        self.allocated = True

    # ---- admission (off the step path) ---------------------------------------------------------
    def add(self, slot: int, spec: ProcessingSpec | None, token_ids, num_prompt_tokens: int) -> None:
        """A request enters the batch in ``slot`` (new, or resumed with its outputs so far)."""
        if spec is None:
            if self.allocated:                  # neutral parameters: this slot's rows pass unchanged
                self._set_params(slot, 0.0, 0.0, 1.0, 0)
                self.bias[slot].zero_()
                self.word_len[slot].zero_()
            return
        if not self.allocated:
            self._allocate()
        dev, v = self.device, self.vocab
        self._set_params(slot, spec.presence_penalty, spec.frequency_penalty, spec.repetition_penalty,
                         spec.min_tokens)
        prompt = np.asarray(token_ids[:num_prompt_tokens], dtype=np.int64)
        out = np.asarray(token_ids[num_prompt_tokens:], dtype=np.int64)
        bias = np.zeros(v, np.float32)
        for t, b in spec.bias:
            bias[t] += b
        ban = np.zeros(v, bool)
        ban[list(spec.min_tokens_banned)] = True
        seen = np.zeros(v, bool)
        seen[prompt] = True
        counts = np.bincount(out, minlength=v + 1).astype(np.int32)
        hist = np.full(_HISTORY, -1, np.int64)
        if len(out):
            tail = out[-_HISTORY:]
            hist[_HISTORY - len(tail):] = tail
        words = np.full((MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS), -2, np.int64)
        lens = np.zeros(MAX_BAD_WORDS, np.int64)
        for i, w in enumerate(spec.bad_words):
            words[i, :len(w)], lens[i] = w, len(w)
        cuda = dev.type == "cuda"
        for dst, src in ((self.bias, bias), (self.min_ban, ban), (self.in_prompt, seen), (self.counts, counts),
                         (self.history, hist), (self.words, words), (self.word_len, lens)):
            # pinned + non_blocking: a pageable upload would wait for the step in flight (a host sync)
            t = torch.from_numpy(src)
            dst[slot] = t.pin_memory().to(dev, non_blocking=True) if cuda else t
        self.num_out[slot] = len(out)

    def _set_params(self, slot: int, presence: float, frequency: float, repetition: float, min_tokens: int):
        self.presence[slot], self.frequency[slot] = presence, frequency
        self.repetition[slot], self.min_tokens[slot] = repetition, min_tokens

    # ---- the step ------------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, slots: torch.Tensor, sample_rows_p: torch.Tensor, num_decode: int,
              drafts: torch.Tensor | None) -> torch.Tensor:
        """Processed float32 logits [L, V] (a new tensor) of a step's logits [L, V]: rows
        ``N_d * (1+K)`` decode/verify rows (row-major: step row, then draft position), then one row
        per sampling prefill row. slots [B] int64 per step row; sample_rows_p [R_p] step rows of
        the sampling prefill rows; drafts [N_d, K] int64 (-1 = none) or None when K = 0. K is the
        step's width (adaptive speculation may verify fewer than num_speculative_tokens)."""
        k = 0 if drafts is None else drafts.shape[1]
        k1, v, dev = 1 + k, self.vocab, self.device
        slot_l = torch.cat([slots[:num_decode].repeat_interleave(k1), slots[sample_rows_p]])     # [L]
        num_p = sample_rows_p.shape[0]
        pos_l = torch.cat([torch.arange(k1, device=dev).repeat(num_decode),
                           torch.zeros(num_p, dtype=torch.int64, device=dev)])               # [L] j
        counts = self.counts[slot_l]                                                          # [L, V+1]
        hist = self.history[slot_l]                                                           # [L, H]
        if k:
            # draft j sees the drafts before it as outputs: counts + one-hot prefix sums [N_d, 1+K, V+1]
            d = torch.where(drafts < 0, v, drafts)                                            # [N_d, K]
            onehot = torch.nn.functional.one_hot(d, v + 1).to(torch.int32).cumsum(1)
            prefix = torch.cat([torch.zeros_like(onehot[:, :1]), onehot], 1).view(-1, v + 1)
            counts = counts + torch.cat([prefix, prefix.new_zeros(num_p, v + 1)])
            # context of each row: history then the drafts (prefill rows: history then nothing)
            ctx_d = torch.cat([hist[:num_decode * k1].view(num_decode, k1, _HISTORY)[:, 0], drafts], 1)  # [N_d, H+K]
            ctx = torch.cat([ctx_d.repeat_interleave(k1, 0),
                             torch.cat([hist[num_decode * k1:], hist.new_full((num_p, k), -1)], 1)])
        else:
            ctx = hist
        counts = counts[:, :v]
        x = logits.float() + self.bias[slot_l]
        x = self._ban_bad_words(x, slot_l, ctx, _HISTORY + pos_l)
        below_min = (self.num_out[slot_l] + pos_l) < self.min_tokens[slot_l]                  # [L]
        x = x.masked_fill(self.min_ban[slot_l] & below_min[:, None], float("-inf"))
        seen = (counts > 0)
        rep = self.repetition[slot_l][:, None]
        x = torch.where(seen | self.in_prompt[slot_l], torch.where(x > 0, x / rep, x * rep), x)
        return x - self.frequency[slot_l][:, None] * counts - self.presence[slot_l][:, None] * seen

    def _ban_bad_words(self, x: torch.Tensor, slot_l: torch.Tensor, ctx: torch.Tensor,
                       end: torch.Tensor) -> torch.Tensor:
        """-inf at the last token of every bad word whose other tokens are ctx[:, end - len + 1:end].
        x [L, V]; ctx [L, C] tokens (-1 = none); end [L] index in ctx after the last output."""
        words, lens = self.words[slot_l], self.word_len[slot_l]                  # [L, W, T], [L, W]
        m = torch.arange(MAX_BAD_WORD_TOKENS - 1, device=x.device)              # prefix index
        idx = end[:, None, None] - (lens[:, :, None] - 1) + m                   # [L, W, T-1]
        in_prefix = m < (lens[:, :, None] - 1)
        got = ctx.gather(1, idx.clamp(min=0, max=ctx.shape[1] - 1).view(len(ctx), -1)).view_as(idx)
        match = ((got == words[:, :, :-1]) | ~in_prefix).all(-1) & (lens > 0)    # [L, W]
        last = words.gather(2, (lens - 1).clamp(min=0)[:, :, None]).squeeze(2)   # [L, W]
        target = torch.where(match, last, self.vocab)                            # V = nothing to ban
        ext = torch.cat([x, x.new_zeros(len(x), 1)], 1)
        return ext.scatter(1, target, float("-inf"))[:, :self.vocab]

    def record(self, sampled: torch.Tensor, slots: torch.Tensor) -> None:
        """After sampling: add each step row's valid tokens (sampled [B, 1+K], -1 pads) to its
        slot's counts, output count and history."""
        valid = sampled >= 0
        tok = torch.where(valid, sampled, self.vocab)
        rows = slots[:, None].expand_as(tok)
        self.counts.index_put_((rows, tok), torch.ones_like(tok, dtype=torch.int32), accumulate=True)
        num_valid = valid.sum(1)
        self.num_out.index_add_(0, slots, num_valid)
        both = torch.cat([self.history[slots], sampled], 1)                     # [B, H+1+K]
        idx = num_valid[:, None] + torch.arange(_HISTORY, device=sampled.device)
        self.history.index_copy_(0, slots, both.gather(1, idx))
