"""How many drafts the next step verifies: fixed, or adaptive per request (``SpeculativeConfig.adaptive``).

The runner owns one policy. Per step it asks ``width(slots)`` (host numpy, the step's rows' Mamba
slots) how many drafts the drafter proposes for the next step; the next step verifies exactly that
many per decode row (``PrevStep.drafts`` is ``[B, width]``, so the width travels with the drafts
and needs no host sync). When a step's output reaches the host for commit, its handle calls
``observe`` with the counts the commit already has (valid tokens and verified drafts per row).

``AdaptiveDrafts`` keeps per request slot (stable for the request's life; ``reset`` when a slot is
given to a request) an exponentially decayed count of accepted and tried draft positions. Under
the usual geometric model the j-th draft of a row is accepted with probability alpha^j, where
alpha = accepted / tried; a row wants the largest k with alpha^k >= ``threshold`` (a draft worth
verifying is one whose acceptance chance beats the relative cost of one more verified token). The
step's width is the largest k among its rows, rounded up to a width the executor has CUDA graphs
for. A row that wants fewer drafts than the step's width still verifies all of them: the step's
columns are paid for anyway, and a cut would only lose tokens.

A row at k = 0 sees no drafts, so it probes: on every ``probe_every * 2**backoff``-th step it asks
for one draft (steps are counted globally, so the probes of many rows coincide on the same steps);
a failed probe doubles its interval (up to ``2**max_backoff``), an accepted one resets it.

Observations of a slot given to another request since its step was launched are dropped (a
generation counter per slot). Nothing here touches the device.
"""
from __future__ import annotations

import math

import numpy as np


class FixedDrafts:
    """Every step verifies ``num_spec`` drafts (``adaptive=False``)."""

    def __init__(self, num_spec: int):
        self.num_spec = num_spec

    def reset(self, slot: int) -> None:
        pass

    def width(self, slots: np.ndarray) -> int:
        return self.num_spec

    def snapshot(self, slots: np.ndarray, num_decode: int, width: int):
        return None

    def observe(self, token, num_valid: np.ndarray) -> None:
        pass


class AdaptiveDrafts:
    def __init__(self, num_spec: int, num_slots: int, *, widths: tuple[int, ...] | None = None,
                 threshold: float = 0.25, decay: float = 0.8, probe_every: int = 8, max_backoff: int = 3):
        """``widths``: the draft counts a step may have (None: any of 0..num_spec); the chosen width
        is rounded up to one of them. ``threshold``: the least acceptance chance of the last draft
        a row asks for. ``decay``: weight of the past per observed step."""
        if not 0.0 < threshold < 1.0 or not 0.0 < decay < 1.0:
            raise ValueError(f"need 0 < threshold < 1 and 0 < decay < 1, got {threshold}, {decay}")
        self.num_spec, self.threshold, self.decay = num_spec, threshold, decay
        self.probe_every, self.max_backoff = probe_every, max_backoff
        allowed = sorted(set(range(num_spec + 1) if widths is None else widths) | {0, num_spec})
        # _round_up[k] = the smallest allowed width >= k
        self._round_up = np.array([min(w for w in allowed if w >= k) for k in range(num_spec + 1)], np.int64)
        self._log_threshold = math.log(threshold)
        # per slot (slot space, null slot 0 included)
        self.accepted = np.zeros(num_slots, np.float64)    # decayed accepted draft positions
        self.tried = np.zeros(num_slots, np.float64)       # decayed tried draft positions
        self.k = np.zeros(num_slots, np.int64)             # drafts the request wants next
        self.backoff = np.zeros(num_slots, np.int64)       # probe interval exponent while k = 0
        self.gen = np.zeros(num_slots, np.int64)           # bumped by reset: late outputs of an old owner
        self.steps = 0                                     # width() calls (the probes' clock)
        self._probe = False                                # the last width() chose a probe
        self._verifying_probe = False                      # the step being launched verifies a probe

    def reset(self, slot: int) -> None:
        """A request got ``slot``: start optimistic (prior alpha = 1 with the weight of half an
        observed position, so two rejected steps bring it to 0), all drafts."""
        self.accepted[slot] = self.tried[slot] = 0.5
        self.k[slot] = self.num_spec
        self.backoff[slot] = 0
        self.gen[slot] += 1

    def width(self, slots: np.ndarray) -> int:
        """Drafts the next step verifies for these rows (slots [B], host)."""
        self.steps += 1
        self._verifying_probe, self._probe = self._probe, False
        if not len(slots):
            return 0
        k = self.k[slots]
        want = int(k.max())
        if want == 0:
            # every row rests: probe with one draft if some row's interval is due
            due = (self.steps % (self.probe_every << self.backoff[slots])) == 0
            want = self._probe = bool(due.any())
        return int(self._round_up[int(want)])

    def snapshot(self, slots: np.ndarray, num_decode: int, width: int):
        """What ``observe`` needs of the step being launched, taken right after its ``width`` call
        (which chose the drafts of the *next* step): its rows' slots [B] and their generations, its
        decode rows (the first ``num_decode``) and the drafts each verified (``width``), and whether
        it verifies a probe (the previous ``width`` call chose one). Generations drop outputs of a
        slot that changed owner; only a failed probe backs off (steps launched before a row came to
        rest are no probes)."""
        return slots[:num_decode], self.gen[slots[:num_decode]], width, self._verifying_probe

    def observe(self, token, num_valid: np.ndarray) -> None:
        """One step's valid tokens per step row (host, from the commit's copy); ``token`` is the
        step's ``snapshot``. A verified column counts as tried whether or not the drafter filled it
        (an n-gram miss wastes the column as much as a rejected draft)."""
        slots, gens, width, probe = token
        n = len(slots)
        if not width or not n:
            return
        nv = num_valid[:n]
        live = (self.gen[slots] == gens) & (nv > 0)
        if not live.all():
            slots, nv = slots[live], nv[live]
        acc = np.clip(nv - 1, 0, width)                    # accepted drafts (a prefix)
        tried = np.minimum(acc + 1, width)                 # columns verified up to the first rejection
        was_resting = self.k[slots] == 0
        a = self.accepted[slots] = self.decay * self.accepted[slots] + acc
        t = self.tried[slots] = self.decay * self.tried[slots] + tried
        alpha = a / np.maximum(t, 1e-9)
        with np.errstate(divide="ignore"):
            ln_alpha = np.log(alpha)
        # largest k with alpha^k >= threshold: k = floor(log(threshold) / log(alpha))
        k = np.where(alpha >= 1.0 - 1e-9, self.num_spec,
                     np.where(alpha <= 0.0, 0, np.floor(self._log_threshold / np.minimum(ln_alpha, -1e-12))))
        k = np.clip(k, 0, self.num_spec).astype(np.int64)
        self.k[slots] = k
        # a resting row whose probe failed backs off; one that wants drafts again probes from scratch
        self.backoff[slots] = np.where(k > 0, 0, np.minimum(self.backoff[slots] + (was_resting & probe),
                                                            self.max_backoff))


def draft_counts(spec_cfg, num_spec: int) -> tuple[int, ...]:
    """The drafts a step may verify: ``(num_spec,)`` without adaptation, else 0, 1, about K/2 and K.
    Executors capture a CUDA graph per count (row width 1 + count), so the set stays small; the
    policy rounds a wanted count up to one of them."""
    if not num_spec:
        return (0,)
    if spec_cfg is None or not spec_cfg.adaptive or spec_cfg.forced_acceptance_rate is not None:
        return (num_spec,)
    return tuple(sorted({0, 1, (num_spec + 1) // 2, num_spec}))


def make_policy(spec_cfg, num_spec: int, num_slots: int, widths: tuple[int, ...] | None):
    """The runner's policy: adaptive unless the config turns it off (or forces acceptance, whose
    point is to measure a fixed K)."""
    if not num_spec:
        return FixedDrafts(0)
    if spec_cfg is None or not spec_cfg.adaptive or spec_cfg.forced_acceptance_rate is not None:
        return FixedDrafts(num_spec)
    return AdaptiveDrafts(num_spec, num_slots, widths=widths)
