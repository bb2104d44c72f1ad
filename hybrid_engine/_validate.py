"""Checks shared by the frozen configuration dataclasses (``config.py``, ``speculative_config.py``)."""
from __future__ import annotations


def check_int(name: str, value, lo: int, hi: int | None = None, allowed: str | None = None) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) in [lo, hi]; ``allowed``
    replaces the range in the message."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        rng = allowed or (f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}")
        raise ValueError(f"{name} must be {rng}, got {value!r}")
