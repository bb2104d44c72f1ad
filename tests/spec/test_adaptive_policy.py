"""Adaptive speculation's policy alone (spec/adaptive.py, no engine): the draft count per request
from its acceptance (two rates: first draft, continuation), probes and back-off, and the one-row
observe path against the batched one. What step costs change (the cost gate, the cost mode, the
step clock) is tests/spec/test_adaptive_costs.py; the engine side is tests/spec/test_adaptive.py."""
import sys
from pathlib import Path

import numpy as np
import pytest

from hybrid_engine import SpeculativeConfig
from hybrid_engine.spec.adaptive import AdaptiveDrafts, FixedDrafts, draft_counts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from adaptive_drive import drive  # noqa: E402


# ---- the policy alone -------------------------------------------------------------------------
def _observe(pol, slots, accepted, verified):
    """One step's counts for decode rows in ``slots``: ``accepted`` drafts of ``verified`` each."""
    slots = np.asarray(slots, np.int64)
    tok = pol.snapshot(slots, len(slots), verified)
    pol.observe(tok, np.asarray(accepted, np.int64) + 1)


def test_policy_shrinks_to_zero_and_grows_back():
    pol = AdaptiveDrafts(4, 8, threshold=0.25, decay=0.8)     # quick to rest (the defaults rest later)
    pol.reset(3)
    assert pol.width(np.array([3])) == 4                       # a new request starts with every draft
    widths = []
    while not widths or widths[-1]:                            # every draft rejected
        _observe(pol, [3], [0], 4)
        widths.append(pol.width(np.array([3])))
    assert 2 <= len(widths) <= 4 and widths == sorted(widths, reverse=True)
    # resting: probes of one draft come on a schedule, not every step
    seen = [pol.width(np.array([3])) for _ in range(16)]
    assert set(seen) == {0, 1} and 1 <= seen.count(1) <= 2
    # acceptance comes back: every verified draft accepted -> grows to all 4 within a few steps
    grown = []
    for _ in range(12):
        w = max(1, pol.width(np.array([3])))                   # verify at least the probe's draft
        _observe(pol, [3], [w], w)
        grown.append(pol.k[3])
    assert grown[-1] == 4 and grown == sorted(grown)


def test_policy_keeps_bursty_drafts_wide():
    """n-gram-like drafts: 40% of steps accept every draft, the others reject the first. Every
    verified draft after an accepted one is accepted, so all K pay whenever the first does; a single
    geometric rate (accepted / verified columns) read 0.4 once a row verified one draft and kept it
    there (the H200 run's adaptive n-gram at 0.90x against 1.39x with K fixed)."""
    pol = AdaptiveDrafts(3, 8, widths=(0, 1, 2, 3))
    pol.reset(1)
    rng = np.random.default_rng(0)
    widths = drive(pol, [1], lambda w: w if rng.random() < 0.4 else 0, 300)
    tail = widths[50:]
    assert tail.count(3) >= 0.9 * len(tail), np.bincount(tail)


def test_policy_retries_wider_after_a_bad_stretch_of_later_drafts():
    """A row whose later drafts were all rejected for a while narrows to one draft (first drafts
    still accepted); once later drafts are accepted again it must find out: steps of one draft
    never verify them, so the continuation rate drifts back up and the row widens again."""
    pol = AdaptiveDrafts(3, 8, widths=(0, 1, 2, 3), threshold=0.1)
    pol.reset(1)
    narrowed = drive(pol, [1], lambda w: min(w, 1), 40)         # draft 1 accepted, draft 2 rejected
    assert 3 not in narrowed[-20:] and narrowed[-20:].count(1) >= 10, narrowed
    regrown = drive(pol, [1], lambda w: w, 40)                   # every draft accepted again
    assert regrown.index(3) <= 20 and regrown[-20:] == [3] * 20, regrown


def test_default_policy_rests_only_after_a_long_run_of_rejections():
    """The defaults (threshold 0.03, decay 0.9) rest a row only when its first drafts almost never
    land: on the GPU a step that verifies no drafts costs nearly what a K-draft step does, and with
    threshold 0.1 adaptive speculation lost to a fixed K in all six trained-model cells of the
    H200 run (2026-11-29). A fresh row whose drafts are all rejected (random weights) rests within
    ~11 steps; one with a good history keeps drafting through 25 rejected steps."""
    pol = AdaptiveDrafts(3, 8)
    pol.reset(1)
    fresh = drive(pol, [1], lambda w: 0, 30)
    assert 8 <= fresh.index(0) <= 14 and fresh[-8:].count(0) >= 6, fresh
    pol.reset(2)
    drive(pol, [2], lambda w: w, 20)
    stretch = drive(pol, [2], lambda w: 0, 45)
    assert stretch[:25] == [3] * 25 and 0 in stretch, stretch


def test_one_row_observe_equals_the_batched_observe():
    """``observe`` of a one-row step takes a plain-float path (batch 1 is where the host bounds the
    step); it must leave exactly the state the numpy path leaves: row 1 alone in one policy,
    row 1 beside row 2 in the other, the same random acceptance, widths, probes and stale outputs."""
    rng = np.random.default_rng(5)
    alone, batched = AdaptiveDrafts(4, 8), AdaptiveDrafts(4, 8)
    ks, backoffs = set(), set()
    for pol in (alone, batched):
        pol.reset(1)
        pol.reset(2)
    for step in range(400):
        width = int(rng.integers(0, 5))
        good = (step // 50) % 2 == 0                                # stretches of good and bad drafts
        acc = int(rng.integers(0, width + 1)) if good and rng.random() < 0.8 else 0
        nv = 0 if rng.random() < 0.05 else acc + 1                  # 0: the row sampled nothing
        probe = bool(rng.random() < 0.2)
        for pol, slots, valid in ((alone, [1], [nv]), (batched, [1, 2], [nv, int(rng.integers(1, width + 2))])):
            slots = np.array(slots, np.int64)
            gens = pol.gen[slots].copy()
            if step % 97 == 0:
                gens[0] -= 1                                        # a late output of the slot's old owner
            pol.observe((slots, gens, width, probe, step, True), np.array(valid, np.int64))
        for name in ("first_accepted", "first_tried", "next_accepted", "next_tried"):
            assert getattr(alone, name)[1] == getattr(batched, name)[1], (name, step)
        assert alone.k[1] == batched.k[1] and alone.backoff[1] == batched.backoff[1], step
        ks.add(int(alone.k[1]))
        backoffs.add(int(alone.backoff[1]))
    assert len(ks) >= 3 and len(backoffs) >= 2, (ks, backoffs)     # the run crossed the rule's branches


def test_rest_puts_a_row_at_rest_through_an_accepted_step_in_flight():
    """``rest`` (warm-up's): the row wants no drafts at once, and the step already launched at full
    width, even if all its drafts are accepted, and one accepted probe keep it there; a row that
    keeps accepting leaves rest within a few probes."""
    pol = AdaptiveDrafts(3, 8)
    pol.reset(1)
    in_flight = pol.snapshot(np.array([1]), 1, 3)            # launched before the rest
    pol.rest(1)
    assert pol.k[1] == 0 and pol.width(np.array([1])) == 0
    pol.observe(in_flight, np.array([4]))                    # every draft accepted
    assert pol.k[1] == 0
    pol.observe(pol.snapshot(np.array([1]), 1, 1), np.array([2]))     # an accepted probe
    assert pol.k[1] == 0
    for _ in range(4):
        pol.observe(pol.snapshot(np.array([1]), 1, 1), np.array([2]))
    assert pol.k[1] == 3


def test_policy_failed_probes_back_off_and_step_width_is_the_max_row():
    pol = AdaptiveDrafts(3, 8, probe_every=4, max_backoff=2, threshold=0.25, decay=0.8)
    for s in (1, 2):
        pol.reset(s)
    for _ in range(8):
        _observe(pol, [1, 2], [0, 3], 3)                      # row 1 always rejects, row 2 always accepts
    assert pol.k[1] == 0 and pol.k[2] == 3
    assert pol.width(np.array([1, 2])) == 3                    # the step verifies what its best row wants
    assert pol.width(np.array([1])) in (0, 1)
    _observe(pol, [1], [0], 1)                                  # not a probe: no back-off
    assert pol.backoff[1] == 0
    for _ in range(3):                                          # rejected probes double the interval
        while pol.width(np.array([1])) == 0:
            pass
        pol.width(np.array([1]))                                # the step that verifies the probe
        _observe(pol, [1], [0], 1)
    assert pol.backoff[1] == 2
    probes = sum(pol.width(np.array([1])) for _ in range(64))
    assert probes == 64 // (4 << 2)


def test_policy_rounds_up_to_captured_widths_and_drops_outputs_of_a_reused_slot():
    pol = AdaptiveDrafts(5, 4, widths=(0, 1, 3, 5))
    pol.reset(1)
    pol.k[1] = 2
    assert pol.width(np.array([1])) == 3
    tok = pol.snapshot(np.array([1]), 1, 3)
    pol.reset(1)                                                # slot 1 now belongs to another request
    pol.observe(tok, np.array([1]))                             # the old owner's late, bad output
    assert pol.k[1] == 5 and pol.first_tried[1] == 0.5


def test_fixed_policy_and_counts():
    assert FixedDrafts(3).width(np.array([1, 2])) == 3
    assert draft_counts(SpeculativeConfig("ngram", 5), 5) == (0, 1, 3, 5)
    assert draft_counts(SpeculativeConfig("ngram", 5, adaptive=False), 5) == (5,)
    assert draft_counts(SpeculativeConfig("ngram", 5, forced_acceptance_rate=0.5), 5) == (5,)
    with pytest.raises(TypeError, match="adaptive"):
        SpeculativeConfig("ngram", 2, adaptive=1)
