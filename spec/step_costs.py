"""How long a step of each width takes: ``StepCosts``, the adaptive policy's clock (``adaptive.py``).

The median of the last few host times between the reads of consecutive steps (the later step's
own time, whether the GPU or the host bounds it; decode-only steps, each key's first sample
dropped) per (width, batch rows rounded up to a power of two). A median, because with a decayed
mean a few slow intervals kept one width's cost at 3.4-6.1 ms against ~0.5 ms for the others on
the H200 (2026-11-29) and held that width off. Which steps count is the policy's choice
(``AdaptiveDrafts.snapshot``).
"""
from __future__ import annotations

import statistics
import time
from collections import deque


class StepCosts:
    """Seconds a step takes per (width, batch-size bucket): the median of the last ``window``
    host times between the reads of consecutive steps (``record`` with the clock's now for each
    read step, in step order). The batch size is rounded up to a power of two: a width's cost
    grows with the rows."""

    def __init__(self, window: int = 16, clock=time.perf_counter):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window, self.clock = window, clock
        self.recent: dict[tuple[int, int], deque] = {}    # (width, bucket) -> the last window seconds
        self.samples: dict[tuple[int, int], int] = {}     # samples seen (all, not only the kept)
        self._median: dict[tuple[int, int], float] = {}   # recent's median, refreshed by get() after a record
        # keys whose first sample was dropped: a width's first step may include one-off work
        # (Triton compiling a kernel in eager mode) that would weigh on the cost for long
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
            if key not in self._warm:
                self._warm.add(key)
            else:
                kept = self.recent.setdefault(key, deque(maxlen=self.window))
                kept.append(now - self._last[1])
                self._median.pop(key, None)          # stale: get() takes the median again
                self.samples[key] = self.samples.get(key, 0) + 1
        self._last = (step, now)

    def get(self, width: int, rows: int) -> float | None:
        key = (width, self.bucket(rows))
        got = self._median.get(key)
        if got is None and key in self.recent:
            got = self._median[key] = statistics.median(self.recent[key])
        return got

    def count(self, width: int, rows: int) -> int:
        return self.samples.get((width, self.bucket(rows)), 0)
