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

With ``step_costs`` (``SpeculativeConfig.adaptive_step_cost``) the policy also weighs what a step
costs: ``StepCosts`` keeps a decayed mean of the host time between the reads of consecutive steps
(the later step's own time, whether the GPU or the host bounds it; decode-only steps, the first
sample of each key dropped) per (width, batch rows rounded up to a power of two), and a step's
width is the allowed one, at most the rows' wish rounded up, with the most expected tokens per
second: sum over rows of (1 + alpha + ... + alpha^w) / cost(w). Untimed widths are tried on every
4th step, and every ``explore_every``-th step re-times the least timed width, so a cost read in a
slow moment is not kept forever. The widths then depend on
timing (the tokens do not: invariant 2 keeps random rows of probabilistic drafters at K); a
tensor-parallel engine refuses it, since its ranks must choose the same widths.
"""
from __future__ import annotations

import math
import time

import numpy as np


class FixedDrafts:
    """Every step verifies ``num_spec`` drafts (``adaptive=False``)."""
    times_steps = False     # wants the steps that verify no drafts too (``StepCosts``)

    def __init__(self, num_spec: int):
        self.num_spec = num_spec

    def reset(self, slot: int) -> None:
        pass

    def width(self, slots: np.ndarray) -> int:
        return self.num_spec

    def snapshot(self, slots: np.ndarray, num_decode: int, width: int, decode_only: bool = False):
        return None

    def observe(self, token, num_valid: np.ndarray) -> None:
        pass


class StepCosts:
    """Seconds a step takes per (width, batch-size bucket): a decayed mean of the host time between
    the reads of consecutive steps (``record`` with the clock's now for each read step, in step
    order). The batch size is rounded up to a power of two: a width's cost grows with the rows."""

    def __init__(self, decay: float = 0.8, clock=time.perf_counter):
        self.decay, self.clock = decay, clock
        self.mean: dict[tuple[int, int], float] = {}      # (width, bucket) -> seconds
        self.samples: dict[tuple[int, int], int] = {}     # samples in the mean
        # keys whose first sample was dropped: a width's first step may include one-off work
        # (Triton compiling a kernel in eager mode) that would weigh on the mean for long
        self._warm: set[tuple[int, int]] = set()
        self._last: tuple[int, float] | None = None       # (step number, read time) of the last read step

    @staticmethod
    def bucket(rows: int) -> int:
        return 1 << max(0, int(rows) - 1).bit_length()

    def record(self, step: int, width: int, rows: int, timed: bool) -> None:
        """Step ``step`` (the policy's step count) was read now; its time is the interval since
        the previous step's read when that was step - 1 and ``timed`` (decode rows only)."""
        now = self.clock()
        if timed and rows and self._last is not None and self._last[0] == step - 1:
            key = (width, self.bucket(rows))
            dt = now - self._last[1]
            if key not in self._warm:
                self._warm.add(key)
                self._last = (step, now)
                return
            old = self.mean.get(key)
            self.mean[key] = dt if old is None else self.decay * old + (1.0 - self.decay) * dt
            self.samples[key] = self.samples.get(key, 0) + 1
        self._last = (step, now)

    def get(self, width: int, rows: int) -> float | None:
        return self.mean.get((width, self.bucket(rows)))

    def count(self, width: int, rows: int) -> int:
        return self.samples.get((width, self.bucket(rows)), 0)


class AdaptiveDrafts:
    def __init__(self, num_spec: int, num_slots: int, *, widths: tuple[int, ...] | None = None,
                 threshold: float = 0.25, decay: float = 0.8, probe_every: int = 8, max_backoff: int = 3,
                 step_costs: StepCosts | None = None, explore_every: int = 64):
        """``widths``: the draft counts a step may have (None: any of 0..num_spec); the chosen width
        is rounded up to one of them. ``threshold``: the least acceptance chance of the last draft
        a row asks for. ``decay``: weight of the past per observed step. ``step_costs``: weigh the
        measured cost of each width too (module docstring), re-measuring the least measured width
        every ``explore_every`` steps."""
        if not 0.0 < threshold < 1.0 or not 0.0 < decay < 1.0:
            raise ValueError(f"need 0 < threshold < 1 and 0 < decay < 1, got {threshold}, {decay}")
        self.num_spec, self.threshold, self.decay = num_spec, threshold, decay
        self.probe_every, self.max_backoff = probe_every, max_backoff
        self.costs, self.explore_every = step_costs, explore_every
        self.times_steps = step_costs is not None        # wants the steps that verify no drafts too
        allowed = sorted(set(range(num_spec + 1) if widths is None else widths) | {0, num_spec})
        self._allowed = tuple(allowed)
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
        width = int(self._round_up[want])
        return width if self.costs is None else self._cheapest(slots, width)

    def _cheapest(self, slots: np.ndarray, most: int) -> int:
        """The allowed width <= ``most`` (the rows' wish, rounded up to an allowed width) with the
        most expected tokens per second for these rows. While a width has no time yet, every 4th
        step tries one and the others take ``most`` (steps with prefill rows are never timed, so
        an untimed width must not hold the step); every explore_every-th step re-times the least
        timed one."""
        rows = len(slots)
        cands = [w for w in self._allowed if w <= most]
        counts = [self.costs.count(w, rows) for w in cands]
        if min(counts) == 0:
            return cands[int(np.argmin(counts))] if self.steps % 4 == 0 else most
        if self.steps % self.explore_every == 0:
            return cands[int(np.argmin(counts))]
        alpha = np.clip(self.accepted[slots] / np.maximum(self.tried[slots], 1e-9), 0.0, 1.0)   # [B]
        # expected tokens of a row verifying w drafts (geometric): 1 + alpha + ... + alpha^w
        powers = alpha[:, None] ** np.arange(most + 1)[None, :]                                  # [B, most+1]
        tokens = np.cumsum(powers, axis=1).sum(0)                                               # [most+1]
        rate = [tokens[w] / self.costs.get(w, rows) for w in cands]
        return cands[int(np.argmax(rate))]

    def snapshot(self, slots: np.ndarray, num_decode: int, width: int, decode_only: bool = False):
        """What ``observe`` needs of the step being launched, taken right after its ``width`` call
        (which chose the drafts of the *next* step): its rows' slots [B] and their generations, its
        decode rows (the first ``num_decode``) and the drafts each verified (``width``), whether
        it verifies a probe (the previous ``width`` call chose one), its step number and whether it
        is decode rows only (its time is then a cost of ``width``). Generations drop outputs of a
        slot that changed owner; only a failed probe backs off (steps launched before a row came to
        rest are no probes)."""
        return (slots[:num_decode], self.gen[slots[:num_decode]], width, self._verifying_probe, self.steps,
                decode_only)

    def observe(self, token, num_valid: np.ndarray) -> None:
        """One step's valid tokens per step row (host, from the commit's copy); ``token`` is the
        step's ``snapshot``. A verified column counts as tried whether or not the drafter filled it
        (an n-gram miss wastes the column as much as a rejected draft)."""
        slots, gens, width, probe, step, decode_only = token
        n = len(slots)
        if self.costs is not None:
            self.costs.record(step, width, n, decode_only)
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
    point is to measure a fixed K); weighing step costs with ``adaptive_step_cost``."""
    if not num_spec:
        return FixedDrafts(0)
    if spec_cfg is None or not spec_cfg.adaptive or spec_cfg.forced_acceptance_rate is not None:
        return FixedDrafts(num_spec)
    costs = StepCosts() if spec_cfg.adaptive_step_cost else None
    return AdaptiveDrafts(num_spec, num_slots, widths=widths, step_costs=costs)
