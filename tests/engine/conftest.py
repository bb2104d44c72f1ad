"""Fixtures of the async + spec regression tests (harness: async_harness.py)."""
import numpy as np
import pytest

from async_harness import OracleDrafter
from hf_reference import hf_greedy
from hybrid_engine.spec.drafters import DRAFTERS


@pytest.fixture
def oracle(monkeypatch):
    """Register the oracle as the "ngram" method; returns the table to fill and the drafters built."""
    table, made = {}, []

    def factory(build, **kw):                 # build: the engine's DrafterBuild
        d = OracleDrafter(build.num_spec, table, seed=len(made), **kw)
        made.append(d)
        return d
    monkeypatch.setitem(DRAFTERS, "ngram", factory)
    return table, made


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(3, 256, n).tolist() for n in (1, 40, 17, 2, 9, 33, 5, 24)]


@pytest.fixture(scope="module")
def hf12(hybrid_dir, prompts):
    return hf_greedy(hybrid_dir, prompts, max_new_tokens=12)
