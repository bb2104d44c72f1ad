"""Drivers of the adaptive draft policy for its tests (tests/spec/test_adaptive_policy.py,
tests/spec/test_adaptive_costs.py): steps taken as the runner takes them, on a fake clock where
costs matter."""
import numpy as np


class Clock:
    """A fake clock: ``now`` advances by what the test says each step costs."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def drive(pol, slots, accepted_of, steps):
    """``steps`` steps as the runner takes them (the next width chosen before this step's read);
    ``accepted_of(width) -> accepted drafts``. -> the widths verified, in order."""
    slots = np.asarray(slots, np.int64)
    widths, width = [], pol.width(slots)
    for _ in range(steps):
        tok = pol.snapshot(slots, len(slots), width)
        nxt = pol.width(slots)
        pol.observe(tok, np.array([accepted_of(width) + 1]))
        widths.append(width)
        width = nxt
    return widths


def timed_drive(pol, clock, step_s, slots, accepted_of, steps):
    """``_drive`` on a fake clock, in the runner's order (the next width, then the snapshot that
    names it): a step of width w takes ``step_s[w]`` seconds; every step is decode rows only.
    ``accepted_of(width) -> accepted drafts`` (the same for each row)."""
    slots = np.asarray(slots, np.int64)
    widths, width = [], pol.width(slots)
    for _ in range(steps):
        nxt = pol.width(slots)                          # launched before this step's read (async)
        tok = pol.snapshot(slots, len(slots), width, decode_only=True, next_width=nxt)
        clock.t += step_s[width]
        pol.observe(tok, np.full(len(slots), accepted_of(width) + 1, np.int64))
        widths.append(width)
        width = nxt
    return widths


def step_costs_of(tables: dict[int, dict[int, float]], samples: int = 3):
    """A StepCosts holding, per batch size rows, ``samples`` kept times of each width's cost
    (``tables[rows][width]`` seconds; each key's first time is dropped, as ``record`` does)."""
    from hybrid_engine.spec.step_costs import StepCosts
    clock = Clock()
    costs, step = StepCosts(clock=clock), 0
    for rows, table in tables.items():
        for width, seconds in table.items():
            costs.record(step, width, rows, True)          # the interval's start (its own key's read)
            for _ in range(samples + 1):
                clock.t += seconds
                step += 1
                costs.record(step, width, rows, True)
            step += 1                                      # no interval across keys
    return costs
