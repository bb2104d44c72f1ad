"""Bad input raises ValueError (a value out of range) or TypeError (a wrong type) naming the field
and what is allowed, before anything is queued; the engine keeps serving."""
import json
import os
import shutil

import numpy as np
import pytest

from hybrid_engine import LLM, SamplingParams

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def llm(hybrid_dir):
    return LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=4, max_model_len=64)


GOOD = [5, 6, 7]


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"n": 0}, "n"),
    ({"n": 1025}, "n"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# issue 20: values that used to pass validation and then broke the step (OverflowError in the
# commit or in the batch's int64/float32 arrays, overflowing divisions), each refused up front
@pytest.mark.parametrize("kwargs, field", [
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"top_k": 2**64}, "top_k"),
    ({"temperature": 10**400}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": 1e-45}, "temperature"),           # logits / T overflows float32: refused, not degenerate
    ({"temperature": 1e4}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"),
])
def test_values_the_step_cannot_serve_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}.*allowed"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": "0.9"}, "top_p"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"stop_token_ids": [1.7]}, "stop_token_ids"),     # used to be truncated to 1 silently
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": True}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"temperature": True}, "temperature"),
])
def test_wrong_types_raise_type_error_naming_the_field(kwargs, field):
    with pytest.raises(TypeError, match=f"SamplingParams.{field}.*allowed"):
        SamplingParams(**kwargs)


def test_accepted_edges():
    """The bounds themselves are served; top_k above the vocabulary keeps every token (documented
    clamp); numpy scalars are numbers."""
    import numpy as np
    SamplingParams(temperature=1e-3, top_k=2**63 - 1, seed=2**63 - 1, max_tokens=2**63 - 1)
    SamplingParams(temperature=1e3, top_p=np.float32(0.5), stop_token_ids=(np.int64(3),))
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_stop_ids_outside_vocabulary_refused_before_queueing(llm):
    with pytest.raises(ValueError, match="stop_token_ids.*vocabulary"):
        llm.generate([GOOD, GOOD], [SamplingParams(), SamplingParams(stop_token_ids=[300])], use_tqdm=False)
    assert not llm.engine.has_work()
    with pytest.raises(TypeError, match="request_id"):
        llm.engine.make_request(GOOD, None, request_id=5)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[5, True]], use_tqdm=False)


def test_large_top_k_and_bad_neighbours_harm_nobody(llm):
    """Issue 20: top_k=2**64 used to fail the whole step (collateral failures); a top_k above the
    vocabulary is now served as "keep every token", beside greedy requests that are unchanged."""
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = llm.generate([GOOD, [9, 10]], greedy, use_tqdm=False)
    wide = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.9, seed=5, top_k=10**12)
    off = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.9, seed=5)
    outs = llm.generate([GOOD, [3, 4], [9, 10], [3, 4]], [greedy, wide, greedy, off], use_tqdm=False)
    assert all(o.error is None for o in outs)
    assert outs[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == ref[1].outputs[0].token_ids
    assert outs[1].outputs[0].token_ids == outs[3].outputs[0].token_ids       # clamp == off


@pytest.mark.parametrize("prompt, words", [
    ([], "empty"),
    ([[]], "empty"),
    ([[5, 300]], "vocabulary"),
    ([[5, -1]], "vocabulary"),
    ([list(range(3, 67))], "max_model_len"),
    ([[1.5, 2]], "token ids"),
    ([[5, True]], "token ids"),
    ([[5, np.bool_(True)]], "token ids"),
    ([[np.int32(5), 2.0]], "token ids"),
    ([[np.int64(5), np.int64(256)]], "vocabulary"),
])
def test_bad_prompts_leave_engine_serving(llm, prompt, words):
    if prompt == []:
        assert llm.generate([], SamplingParams(max_tokens=2), use_tqdm=False) == []
        return
    with pytest.raises(ValueError, match=words):
        llm.generate([GOOD] + prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_work()                    # nothing was queued, GOOD included
    out = llm.generate([GOOD], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_params_count_mismatch(llm):
    with pytest.raises(ValueError, match="params"):
        llm.generate([GOOD, GOOD], [SamplingParams(), SamplingParams(), SamplingParams()], use_tqdm=False)


def test_text_prompt_without_tokenizer(llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello", use_tqdm=False)


@pytest.mark.parametrize("kwargs, field", [
    ({"dtype": "float8"}, "dtype"),
    ({"device": "tpu"}, "device"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
])
def test_bad_engine_args(hybrid_dir, kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(hybrid_dir, **kwargs)


def test_bad_model_folders(hybrid_dir, tmp_path):
    with pytest.raises(ValueError, match="config"):
        LLM(tmp_path)                                   # no config.json
    d = tmp_path / "noweights"
    d.mkdir()
    shutil.copy(hybrid_dir / "config.json", d / "config.json")
    with pytest.raises(ValueError, match="weight|safetensors"):
        LLM(d)
    cfg = json.loads((hybrid_dir / "config.json").read_text())
    for key, value, words in [("model_type", "llama", "model_type"), ("layers_block_type", ["mamba2"], "layer")]:
        bad = tmp_path / f"bad_{key}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(ValueError, match=words):
            LLM(bad)


def test_checkpoint_tensor_problems(hybrid_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(hybrid_dir / "model.safetensors"))
    for case in ("missing", "shape"):
        d = tmp_path / case
        d.mkdir()
        shutil.copy(hybrid_dir / "config.json", d / "config.json")
        t = dict(tensors)
        name = "backbone.layers.0.mixer.A_log"
        if case == "missing":
            del t[name]
        else:
            t[name] = t[name][:-1].clone()
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match="layers.0.mixer.A_log"):
            LLM(d)


def test_request_that_can_never_fit_the_cache(hybrid_dir):
    """prompt + max_tokens beyond the whole KV cache would preempt itself forever: refuse it."""
    small = LLM(hybrid_dir, dtype="float32", device=DEV, block_size=4, num_kv_blocks=10, max_model_len=100)
    with pytest.raises(ValueError, match="max_tokens"):
        small.generate([GOOD], SamplingParams(max_tokens=40), use_tqdm=False)
    out = small.generate([GOOD], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 20


def test_numpy_scalars_become_python_numbers(llm):
    """numpy int64 arithmetic wraps around silently: accepted values are stored as Python numbers,
    so a max_tokens at the int64 limit simply runs to max_model_len."""
    import numpy as np
    p = SamplingParams(max_tokens=np.int64(2**63 - 1), temperature=np.float32(0.5), seed=np.int64(3))
    assert type(p.max_tokens) is int and type(p.temperature) is float and type(p.seed) is int
    out = llm.generate([GOOD], SamplingParams(max_tokens=np.int64(2**63 - 1), ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length" and out[0].error is None
    assert len(out[0].outputs[0].token_ids) == 64 - len(GOOD)
