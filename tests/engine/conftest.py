"""Fixtures of the async + spec regression tests (harness: async_harness.py) and the model the
sampling-feature tests share (test_logits_processing.py, test_logprobs.py, test_stop_strings.py)."""
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


@pytest.fixture(scope="module")
def tok_dir(model_dirs):
    """A small hybrid with a tokenizer and an MTP layer (every drafter method can run on it)."""
    return model_dirs("stop_tok", pattern="M-M*-", vocab_size=300, with_tokenizer=True, seed=2,
                      num_nextn_predict_layers=1)
