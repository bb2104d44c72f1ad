"""Bad input raises ValueError naming the field, before anything is queued; the engine keeps serving."""
import json
import os
import shutil

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
    ({"n": 2}, "n"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, words", [
    ([], "empty"),
    ([[]], "empty"),
    ([[5, 300]], "vocabulary"),
    ([[5, -1]], "vocabulary"),
    ([list(range(3, 67))], "max_model_len"),
    ([[1.5, 2]], "token ids"),
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
