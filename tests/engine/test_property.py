"""Property-based: random SamplingParams, prompts and request ids thrown at a running engine. Each
is either refused with a ValueError/TypeError naming what is wrong, before anything is queued, or
served to a normal end ("stop"/"length", tokens in the vocabulary, at most max_tokens); the
companion request running beside it always equals its undisturbed output."""
import math
import os

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.llm import _output

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop_token_ids", "ignore_eos", "n")

anything = st.one_of(
    st.none(), st.booleans(), st.integers(-2**70, 2**70), st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.text(max_size=3),
    st.lists(st.integers(-5, 2**65), max_size=3), st.lists(st.floats(0, 300), max_size=2))
field_values = {
    "max_tokens": st.one_of(st.integers(-2, 6), anything),
    "temperature": st.one_of(st.sampled_from([0, 0.0, 0.5, 1.0, 1e-45, 1e-3, 1e3, 1e4, 1e308, 10**400, float("inf"), float("nan")]),
                             st.floats(0, 3), anything),
    "top_k": st.one_of(st.integers(-2, 400), st.just(2**64), anything),
    "top_p": st.one_of(st.floats(0, 1.2), anything),
    "min_p": st.one_of(st.floats(-0.1, 1.1), anything),
    "seed": st.one_of(st.none(), st.integers(-1, 2**64), anything),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 300), max_size=3), st.just([2**64]), anything),
    "ignore_eos": st.one_of(st.booleans(), anything),
    "n": st.one_of(st.just(1), anything),
}
valid_values = {
    "max_tokens": st.integers(1, 6), "temperature": st.one_of(st.just(0.0), st.floats(1e-3, 1e3)),
    "top_k": st.one_of(st.just(-1), st.integers(1, 2**63 - 1)), "top_p": st.floats(0.01, 1.0),
    "min_p": st.floats(0.0, 1.0), "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "stop_token_ids": st.lists(st.integers(0, 255), max_size=3), "ignore_eos": st.booleans(),
}
# half the draws only valid values (so requests are served), half anything (so refusals are hit)
params_kw = st.one_of(st.fixed_dictionaries({}, optional=valid_values),
                      st.fixed_dictionaries({}, optional=field_values))
prompts = st.one_of(st.lists(st.integers(0, 255), min_size=1, max_size=20),st.lists(st.integers(-2, 300), max_size=12), st.lists(st.booleans(), max_size=3),
                    st.lists(st.floats(0, 10), max_size=3), st.text(max_size=4), st.integers(), st.none(),
                    st.lists(st.integers(3, 255), min_size=1, max_size=20))
request_ids = st.one_of(st.none(), st.text(max_size=6), st.integers(), st.booleans())


@pytest.fixture(scope="module")
def engine(hybrid_dir):
    return LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=3, max_model_len=24).engine


@pytest.fixture(scope="module")
def companion(engine):
    p = SamplingParams(max_tokens=4, temperature=0.7, seed=11, ignore_eos=True)
    req = engine.make_request([7, 8, 9, 10], p, "companion")
    engine.add_request(req)
    while engine.has_work():
        engine.step()
    engine.scheduler.pop_finished("companion")
    return p, list(req.output_token_ids)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(kw=params_kw, prompt=prompts, rid=request_ids)
def test_random_requests_are_refused_clearly_or_served(engine, companion, kw, prompt, rid):
    try:
        params = SamplingParams(**kw)
    except (ValueError, TypeError) as e:
        assert any(f in str(e) for f in kw), f"message names no field: {e}"
        event("params refused")
        return
    # accepted: every field holds a value the step can serve
    assert params.temperature == 0 or 1e-3 <= params.temperature <= 1e3
    assert all(isinstance(t, int) and not isinstance(t, bool) for t in params.stop_token_ids)
    assert math.isfinite(params.top_p) and math.isfinite(params.min_p)
    comp_params, comp_tokens = companion
    comp = engine.make_request([7, 8, 9, 10], comp_params, "companion")
    engine.add_request(comp)
    try:
        req = engine.make_request(prompt, params, rid)
        engine.add_request(req)                 # a request_id in use ("companion") is refused here
    except (ValueError, TypeError) as e:
        assert str(e)
        assert list(engine.scheduler.requests) == ["companion"]          # nothing of it was queued
        event("request refused")
        req = None
    while engine.has_work():
        engine.step()
    assert list(comp.output_token_ids) == comp_tokens and comp.error is None
    engine.scheduler.pop_finished("companion")
    if req is None:
        return
    event("served")
    out = _output(engine, req)
    engine.scheduler.pop_finished(req.request_id)
    assert out.error is None and out.outputs[0].finish_reason in ("stop", "length"), out
    toks = out.outputs[0].token_ids
    assert 1 <= len(toks) <= params.max_tokens
    assert all(0 <= t < engine.cfg.model.vocab_size for t in toks)
    st_ = engine.stats()
    assert st_["free_slots"] == st_["total_slots"] and st_["free_blocks"] == st_["total_blocks"]
