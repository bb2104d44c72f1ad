"""How many drafts the next step verifies: fixed, or adaptive per request (``SpeculativeConfig.adaptive``).

The runner owns one policy. Per step it asks ``width(slots)`` (host numpy, the step's rows' Mamba
slots) how many drafts the drafter proposes for the next step; the next step verifies exactly that
many per decode row (``PrevStep.drafts`` is ``[B, width]``, so the width travels with the drafts
and needs no host sync). When a step's output reaches the host for commit, its handle calls
``observe`` with the counts the commit already has (valid tokens and verified drafts per row).

``AdaptiveDrafts`` keeps per request slot (stable for the request's life; ``reset`` when a slot is
given to a request) exponentially decayed counts of two acceptance rates: ``p1``, that a row's
first draft is accepted, and ``c``, that a later draft is accepted when every draft before it was.
The j-th draft is then accepted with probability p1 * c^(j-1), and a row wants the largest k whose
k-th draft has p1 * c^(k-1) >= ``threshold`` (a draft worth verifying is one whose acceptance
chance beats the relative cost of one more verified token). Why two rates, not one geometric
alpha: n-gram drafts come in bursts (a match is either there, and then it copies for several
tokens, or it is not: 0.41 / 0.39 / 0.39 per position on the trained bench-large model), and a
single alpha fitted while a row verifies one draft sees only the first position's rate, so a row
that narrowed to one draft stayed there (2026-11-29 H200 run: adaptive n-gram at 0.90x of no
speculation where a fixed K = 3 ran at 1.39x). The step's width is the largest k among its rows,
rounded up to a width the executor has CUDA graphs for. A row that wants fewer drafts than the
step's width still verifies all of them: the step's columns are paid for anyway, and a cut would
only lose tokens.

A row at k = 0 sees no drafts, so it probes: on every ``probe_every * 2**backoff``-th step it asks
for one draft (steps are counted globally, so the probes of many rows coincide on the same steps);
a failed probe doubles its interval (up to ``2**max_backoff``), an accepted one resets it if the
row then wants drafts again (with the cost gate, only if they pay for their cost).

Observations of a slot given to another request since its step was launched are dropped (a
generation counter per slot). Nothing here touches the device.

Resting by measured cost. A model drafter's first draft is not one more verified token: it is the
drafter's own pass (the MTP block, the draft model), which on a small host-bound model costs most
of a greedy step (bench-large at random weights, H200: a one-draft MTP step 0.665 ms, a resting
step 0.367 ms), while on a large model it is a small fraction. So an adaptive engine times its
steps per width (``StepCosts`` below, the same measurement as the cost mode's) and a row also
rests when no width w it may take pays for itself: its expected tokens a step,
1 + p1 * (1 + c + ... + c^(w-1)), stay below 0.9 of that width's measured cost relative to a
resting step, cost(w) / cost(0), for every width timed at this batch size (``_pays``; 0.9: a
margin for the noise of p1, see ``_THROUGHPUT_FLOOR``). Until width 0 and a drafting width are both
timed the threshold rule alone decides; where width 0 has not been timed at a batch size, the
policy rests for two short runs of steps to time it (``_times_rest``). Only steady steps are
timed (``snapshot``: a step's time includes the proposal for the next one). The widths a
drafting row takes are still the threshold rule's: on the trained bench-large model choosing them
by cost lost to it in every cell (H200, 2026-11-29: n-gram edit 1.48x against 1.83x).

With ``choose_by_cost`` (``SpeculativeConfig.adaptive_step_cost``) the policy also weighs what a
step costs to choose a drafting step's width (``StepCosts``, ``spec/step_costs.py``: medians of
host times per width and batch bucket): a step's width is the allowed one, at most the rows' wish
rounded up, with the most expected tokens per second: sum over rows of (1 + p1 * (1 + c + ... + c^(w-1))) / cost(w).
Untimed widths are tried on every 4th step, and every ``explore_every``-th step re-times the least
timed width, so a cost read in a slow moment is not kept forever. With either use of the costs the
widths depend on timing. The tokens do not, except where a step's row count changes the bits
(16-bit or quantized weights on a GPU: docs/design.md invariant 2), and random rows of
probabilistic drafters keep K. A tensor-parallel engine times nothing
(``make_policy(timed=False)``), since its ranks must choose the same widths.
"""
from __future__ import annotations

import math

import numpy as np

from .step_costs import StepCosts


_PSEUDO = 0.05     # AdaptiveDrafts.observe: the continuation rate's pull back to 1 per unseen step
_TIE = 1e-9        # AdaptiveDrafts.observe: slack on the k rule's floor (both paths agree at ties)
_MIN_TIMED = 2     # AdaptiveDrafts._extra_costs: kept samples of a width before its cost counts
# AdaptiveDrafts._pays: a row rests only when, at every timed width, drafting would yield below this
# share of a resting step's tokens per second. p1 is a decayed estimate over ~10 observations, and
# a resting row is re-measured only by its probes (one draft every 8-64 steps), so resting on an
# estimate that a run of rejections pushed low is expensive; the floor keeps a row drafting where
# drafting is cheap (an extra cost under 0.11 never rests it: the threshold rule decides there).
# With a floor of 1.0 a row accepting 20% of first drafts where drafting cost 0.2 extra rested
# for about half of its steps
_THROUGHPUT_FLOOR = 0.9
# AdaptiveDrafts._times_rest: while width 0 has been timed fewer than _REST_TIMED times at a batch
# size (no row rested there yet) and the drafting width is timed, every _REST_EVERY-th step starts a
# run of _REST_RUN steps at width 0: the first two are steady resting steps (timed; the first
# sample of a key is dropped), the last drafts again (not steady: untimed), so two runs time it
_REST_TIMED, _REST_EVERY, _REST_RUN = 3, 32, 3


class FixedDrafts:
    """Every step verifies ``num_spec`` drafts (``adaptive=False``)."""
    times_steps = False     # wants the steps that verify no drafts too (``StepCosts``)

    def __init__(self, num_spec: int):
        self.num_spec = num_spec

    def reset(self, slot: int) -> None:
        pass

    def forget_costs(self) -> None:
        pass

    def stop_timing(self) -> None:
        pass

    def width(self, slots: np.ndarray) -> int:
        return self.num_spec

    def snapshot(self, slots: np.ndarray, num_decode: int, width: int, decode_only: bool = False):
        return None

    def observe(self, token, num_valid: np.ndarray) -> None:
        pass


class AdaptiveDrafts:
    def __init__(self, num_spec: int, num_slots: int, *, widths: tuple[int, ...] | None = None,
                 threshold: float = 0.03, decay: float = 0.9, probe_every: int = 8, max_backoff: int = 3,
                 step_costs: StepCosts | None = None, choose_by_cost: bool = False, explore_every: int = 64):
        """``widths``: the draft counts a step may have (None: any of 0..num_spec); the chosen width
        is rounded up to one of them. ``threshold``: the least acceptance chance of the last draft
        a row asks for. ``decay``: weight of the past per observed step. ``step_costs``: the
        steps' measured costs, which rest a row whose drafts do not pay for them (module
        docstring; None: the threshold rule alone). ``choose_by_cost``: also choose a drafting
        step's width by them (the cost mode; needs ``step_costs``), re-measuring the least
        measured width every ``explore_every`` steps."""
        if choose_by_cost and step_costs is None:
            raise ValueError("choose_by_cost needs step_costs")
        if not 0.0 < threshold < 1.0 or not 0.0 < decay < 1.0:
            raise ValueError(f"need 0 < threshold < 1 and 0 < decay < 1, got {threshold}, {decay}")
        # threshold and decay may be changed between steps (tests that need rows to rest sooner)
        self.num_spec, self.threshold, self.decay = num_spec, threshold, decay
        self.probe_every, self.max_backoff = probe_every, max_backoff
        self.costs, self.choose_by_cost, self.explore_every = step_costs, choose_by_cost, explore_every
        self.times_steps = step_costs is not None        # wants the steps that verify no drafts too
        allowed = sorted(set(range(num_spec + 1) if widths is None else widths) | {0, num_spec})
        self._allowed = tuple(allowed)
        # _round_up[k] = the smallest allowed width >= k
        self._round_up = np.array([min(w for w in allowed if w >= k) for k in range(num_spec + 1)], np.int64)
        # per slot (slot space, null slot 0 included)
        self.first_accepted = np.zeros(num_slots, np.float64)   # decayed: first drafts accepted
        self.first_tried = np.zeros(num_slots, np.float64)      # decayed: first drafts verified
        self.next_accepted = np.zeros(num_slots, np.float64)    # decayed: later drafts accepted ...
        self.next_tried = np.zeros(num_slots, np.float64)       # ... of those verified after accepted ones
        self.k = np.zeros(num_slots, np.int64)             # drafts the request wants next
        self.backoff = np.zeros(num_slots, np.int64)       # probe interval exponent while k = 0
        self.gen = np.zeros(num_slots, np.int64)           # bumped by reset: late outputs of an old owner
        self.steps = 0                                     # width() calls (the probes' clock)
        self._probe = False                                # the last width() chose a probe
        self._verifying_probe = False                      # the step being launched verifies a probe

    def stop_timing(self) -> None:
        """From now on acceptance alone decides (no gate, no timed resting runs): for tests whose
        width schedules were counted under the acceptance rule, where host timing must not move them."""
        if self.choose_by_cost:
            raise ValueError("stop_timing: this policy chooses widths by cost (adaptive_step_cost)")
        self.costs, self.times_steps = None, False

    def forget_costs(self) -> None:
        """Drop every step time taken so far (warm-up's steps: compiling, logprob and penalty rows,
        first uses of kernels): serving times its own."""
        if self.costs is not None:
            self.costs = StepCosts(window=self.costs.window, clock=self.costs.clock)

    def reset(self, slot: int) -> None:
        """A request got ``slot``: start optimistic (prior p1 = c = 1, each with the weight of half an
        observed position: with the defaults ten rejected steps bring a new row to rest), all drafts."""
        self.first_accepted[slot] = self.first_tried[slot] = 0.5
        self.next_accepted[slot] = self.next_tried[slot] = 0.5
        self.k[slot] = self.num_spec
        self.backoff[slot] = 0
        self.gen[slot] += 1

    def rest(self, slot: int) -> None:
        """Put ``slot``'s request at rest now: no drafts, probes at the longest interval, and a
        first-draft rate of 0 with the weight of ten windows of rejections, so that the step already
        chosen at full width (a width is chosen a step ahead) and a probe or two, even if accepted,
        keep it at rest. Warm-up's way to reach the steps of resting requests
        (``warmup._mixed_wave``) without waiting for rejections, which a trained drafter may
        never give."""
        self.first_accepted[slot] = 0.0
        self.first_tried[slot] = 10.0 / (1.0 - self.decay)
        self.k[slot] = 0
        self.backoff[slot] = self.max_backoff

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
        if self.choose_by_cost:
            return self._cheapest(slots, width)
        return 0 if self._times_rest(len(slots), width) else width

    def _times_rest(self, rows: int, width: int) -> bool:
        """Whether this step rests to time width 0 (``_REST_TIMED`` and co.). Without it the cost
        gate could only act after the threshold rule had rested some row at this batch size: an
        n-gram engine at acceptance length 1.88 on the CPU, its K = 3 steps costing 2.9x a greedy
        step (0.66x of no speculation), never rested, so never timed width 0."""
        costs = self.costs
        if costs is None or costs.count(0, rows) >= _REST_TIMED or costs.count(width, rows) < _MIN_TIMED:
            return False
        return self.steps % _REST_EVERY < _REST_RUN

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
        tokens = self.expected_tokens(slots, most)
        rate = [tokens[w] / self.costs.get(w, rows) for w in cands]
        return cands[int(np.argmax(rate))]

    def expected_tokens(self, slots: np.ndarray, most: int) -> np.ndarray:
        """[most + 1]: tokens a step of these rows yields if it verifies w = 0..most drafts, summed
        over rows: 1 + p1 * (1 + c + ... + c^(w-1)) each."""
        p1, c = self._rates(slots)                                                              # [B], [B]
        powers = c[:, None] ** np.arange(most)[None, :]                                         # [B, most]
        return len(slots) + np.concatenate([[0.0], (p1[:, None] * np.cumsum(powers, axis=1)).sum(0)])

    def _rates(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> (p1 [B], c [B]): each row's first-draft and continuation acceptance rates."""
        p1 = self.first_accepted[slots] / np.maximum(self.first_tried[slots], 1e-9)
        c = self.next_accepted[slots] / np.maximum(self.next_tried[slots], 1e-9)
        return np.clip(p1, 0.0, 1.0), np.clip(c, 0.0, 1.0)

    def snapshot(self, slots: np.ndarray, num_decode: int, width: int, decode_only: bool = False,
                 next_width: int | None = None):
        """What ``observe`` needs of the step being launched, taken right after its ``width`` call
        (which chose the drafts of the *next* step): its rows' slots [B] and their generations, its
        decode rows (the first ``num_decode``) and the drafts each verified (``width``), whether
        it verifies a probe (the previous ``width`` call chose one), its step number and whether
        its time is a cost of ``width``: decode rows only and, for the gate, a steady step, one
        that drafts ``next_width`` == ``width`` for the next step (None: taken as steady). A step's
        time includes the drafter's proposal for the next step, so a probe that verifies one
        draft and then only follows costs what a resting step does (the general path's CPU run
        timed width 1 at 9.1 ms against 9.2 for width 0 and 25.9 for width 3, and the gate never
        rested anyone). Generations drop outputs of a slot that changed owner; only a failed probe
        backs off (steps launched before a row came to rest are no probes)."""
        steady = self.choose_by_cost or next_width is None or next_width == width
        return (slots[:num_decode], self.gen[slots[:num_decode]], width, self._verifying_probe, self.steps,
                decode_only and steady)

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
        if n == 1:           # batch 1 (where the step is host-bound): plain floats, ~5x fewer us
            self._observe_row(int(slots[0]), int(gens[0]), int(num_valid[0]), width, probe)
            return
        nv = num_valid[:n]
        live = (self.gen[slots] == gens) & (nv > 0)
        if not live.all():
            slots, nv = slots[live], nv[live]
        acc = np.clip(nv - 1, 0, width)                    # accepted drafts (a prefix)
        was_resting = self.k[slots] == 0
        d = self.decay
        fa = self.first_accepted[slots] = d * self.first_accepted[slots] + (acc > 0)
        ft = self.first_tried[slots] = d * self.first_tried[slots] + 1.0
        # drafts 2..min(acc + 1, width) were verified after accepted ones, acc - 1 of them accepted.
        # A step that verified none of them adds a small accepted pseudo-count instead: c drifts
        # back up (from ~0 with decay 0.9: ~0.27 after 20 such steps, ~0.9 after ~50), so a row
        # that narrowed to one draft on a bad stretch tries more again (else nothing would ever
        # re-measure its c; with threshold 0.03 one step of c >= 0.03 / p1 is enough)
        tried_next = np.minimum(acc, width - 1)
        seen = tried_next > 0
        na = self.next_accepted[slots] = d * self.next_accepted[slots] + np.where(seen, np.maximum(acc - 1, 0),
                                                                                 _PSEUDO)
        nt = self.next_tried[slots] = d * self.next_tried[slots] + np.where(seen, tried_next, _PSEUDO)
        p1, c = fa / ft, np.minimum(na / np.maximum(nt, 1e-9), 1.0)
        # largest k with p1 * c^(k-1) >= threshold: 0 if p1 < threshold, else
        # 1 + floor(log(threshold / p1) / log(c)) (every draft when c = 1)
        with np.errstate(divide="ignore"):
            ratio = (math.log(self.threshold) - np.log(np.maximum(p1, 1e-12))) / np.minimum(np.log(c), -1e-12)
        # + _TIE: at p1 * c^j == threshold the logs' last bits (numpy's or math's) decide nothing
        more = np.maximum(np.floor(ratio + _TIE), 0)
        k = np.where(p1 < self.threshold, 0, np.where(c >= 1.0 - 1e-9, self.num_spec, 1 + more))
        k = np.clip(k, 0, self.num_spec).astype(np.int64)
        extra = self._extra_costs(n)
        if extra:
            k = np.where(self._pays(p1, c, extra), k, 0)
        self.k[slots] = k
        # a resting row whose probe failed backs off; one that wants drafts again probes from scratch
        self.backoff[slots] = np.where(k > 0, 0, np.minimum(self.backoff[slots] + (was_resting & probe),
                                                            self.max_backoff))

    def _observe_row(self, slot: int, gen: int, nv: int, width: int, probe: bool) -> None:
        """``observe`` of one row, the same arithmetic in Python floats (numpy's per-call cost on
        one-element arrays made it ~30 us per step; tests compare the two paths)."""
        if self.gen[slot] != gen or nv <= 0:
            return
        acc = min(nv - 1, width)
        was_resting = self.k[slot] == 0
        d = self.decay
        fa = d * float(self.first_accepted[slot]) + (acc > 0)
        ft = d * float(self.first_tried[slot]) + 1.0
        tried_next = min(acc, width - 1)
        seen = tried_next > 0
        na = d * float(self.next_accepted[slot]) + (max(acc - 1, 0) if seen else _PSEUDO)
        nt = d * float(self.next_tried[slot]) + (tried_next if seen else _PSEUDO)
        self.first_accepted[slot], self.first_tried[slot] = fa, ft
        self.next_accepted[slot], self.next_tried[slot] = na, nt
        p1, c = fa / ft, min(na / max(nt, 1e-9), 1.0)
        if p1 < self.threshold:
            k = 0
        elif c >= 1.0 - 1e-9:
            k = self.num_spec
        else:
            ln_c = math.log(c) if c > 0.0 else -math.inf
            ratio = (math.log(self.threshold) - math.log(max(p1, 1e-12))) / min(ln_c, -1e-12)
            k = 1 + max(math.floor(ratio + _TIE), 0)
        k = min(max(k, 0), self.num_spec)
        if k:
            extra = self._extra_costs(1)
            if extra and not self._pays(p1, c, extra):
                k = 0
        self.k[slot] = k
        self.backoff[slot] = 0 if k > 0 else min(int(self.backoff[slot]) + (was_resting and probe), self.max_backoff)

    def _extra_costs(self, rows: int) -> list[tuple[int, float]]:
        """[(w, cost(w) / cost(0) - 1)], in increasing w, for the allowed widths w > 0 timed at
        ``rows`` decode rows (each width and width 0 at least ``_MIN_TIMED`` times); [] without
        step costs."""
        costs = self.costs
        if costs is None or costs.count(0, rows) < _MIN_TIMED:
            return []
        base = costs.get(0, rows)
        if not base > 0.0:                      # a clock that did not advance: no cost is known
            return []
        return [(w, costs.get(w, rows) / base - 1.0) for w in self._allowed
                if w and costs.count(w, rows) >= _MIN_TIMED]

    @staticmethod
    def _pays(p1, c, extra: list[tuple[int, float]]):
        """Whether some timed width w may pay for itself: its expected tokens a step,
        1 + p1 * (1 + c + ... + c^(w-1)), at least ``_THROUGHPUT_FLOOR`` times its cost
        relative to a resting step, 1 + extra cost. p1, c: floats (one row) or arrays [B] (then
        [B] bool); ``extra`` in increasing widths. The sum grows term by term in the same order
        for both, so the one-row and the batched observe agree to the bit."""
        pays, total, term, terms = False, 1.0, 1.0, 1
        for w, extra_cost in extra:
            for _ in range(w - terms):
                term = term * c
                total = total + term
            terms = w
            pays = pays | (1.0 + p1 * total >= _THROUGHPUT_FLOOR * (1.0 + extra_cost))
        return pays


def draft_counts(spec_cfg, num_spec: int) -> tuple[int, ...]:
    """The drafts a step may verify: ``(num_spec,)`` without adaptation, else 0, 1, about K/2 and K.
    Executors capture a CUDA graph per count (row width 1 + count), so the set stays small; the
    policy rounds a wanted count up to one of them."""
    if not num_spec:
        return (0,)
    if spec_cfg is None or not spec_cfg.adaptive or spec_cfg.forced_acceptance_rate is not None:
        return (num_spec,)
    return tuple(sorted({0, 1, (num_spec + 1) // 2, num_spec}))


def make_policy(spec_cfg, num_spec: int, num_slots: int, widths: tuple[int, ...] | None, *,
                timed: bool = True):
    """The runner's policy: adaptive unless the config turns it off (or forces acceptance, whose
    point is to measure a fixed K), timing its steps (a row whose drafts do not pay for their
    measured cost rests); choosing drafting widths by those costs too with ``adaptive_step_cost``.
    ``timed`` False (tensor parallelism: every rank must choose the same widths, and timings
    differ between ranks): acceptance alone decides."""
    if not num_spec:
        return FixedDrafts(0)
    if spec_cfg is None or not spec_cfg.adaptive or spec_cfg.forced_acceptance_rate is not None:
        return FixedDrafts(num_spec)
    if spec_cfg.adaptive_step_cost and not timed:
        raise ValueError("adaptive_step_cost needs a policy that times its steps (no tensor parallelism)")
    return AdaptiveDrafts(num_spec, num_slots, widths=widths, step_costs=StepCosts() if timed else None,
                          choose_by_cost=spec_cfg.adaptive_step_cost)
