"""Checkpoint folders as published and as found in the wild: tensor-name prefixes, config spellings,
quantized or corrupt files, generation_config.json, and the default-model cache. Every bad folder
is a ValueError naming the file / tensor / field, raised while the engine is built (before any
request can be accepted)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_reference import hf_greedy
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.config import ModelConfig
from hybrid_engine.models.synthetic import make_hf_model
from published_models import rename_prefix

PROMPT = [5, 9, 17, 33, 60, 7, 100, 3, 42, 11, 250, 8]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("ckpt") / "m", pattern="M*-ME", seed=2)


@pytest.fixture(scope="module")
def ref(base):
    return hf_greedy(base, [PROMPT], 6)[0]


def _copy(base, tmp_path, name="m"):
    d = tmp_path / name
    shutil.copytree(base, d)
    return d


def _edit_tensors(d, fn):
    sd = load_file(str(d / "model.safetensors"))
    sd = fn(sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})


def _edit_config(d, **kw):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


def _greedy(d, max_tokens=6, **kw):
    llm = LLM(d, dtype="float32", device="cpu", max_num_seqs=1, **kw)
    return llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)[0]


# ---- names and spellings ----------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["model.", ""])
def test_model_prefix_and_unprefixed_load(base, ref, tmp_path, prefix):
    d = _copy(base, tmp_path)
    _edit_tensors(d, lambda sd: rename_prefix(sd, prefix))
    names = load_file(str(d / "model.safetensors")).keys()
    assert not any(n.startswith("backbone.") for n in names)
    assert _greedy(d).outputs[0].token_ids == ref


def test_mixed_prefixes_rejected(base, tmp_path):
    d = _copy(base, tmp_path)
    _edit_tensors(d, lambda sd: {("model." + k[9:] if k.startswith("backbone.layers.0.") else k): v
                                 for k, v in sd.items()})
    with pytest.raises(ValueError, match=r"mixes backbone\.\* and model\.\*"):
        LLM(d, dtype="float32", device="cpu")


def test_config_spellings():
    base = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*", "hidden_size": 64,
            "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_num_heads": 8, "n_groups": 2,
            "vocab_size": 256}
    assert ModelConfig.from_dict({**base, "attention_head_dim": 16}).head_dim == 16
    assert ModelConfig.from_dict({**base, "attention_head_dim": 16, "head_dim": 32}).head_dim == 32
    assert ModelConfig.from_dict({**base, "dtype": "bfloat16"}).torch_dtype == "bfloat16"
    assert ModelConfig.from_dict({**base, "torch_dtype": "torch.float16"}).torch_dtype == "float16"
    with pytest.raises(ValueError, match="hidden_size must be an integer"):
        ModelConfig.from_dict({**base, "hidden_size": "64"})
    with pytest.raises(ValueError, match="eos_token_id 300 is outside the vocabulary"):
        ModelConfig.from_dict({**base, "eos_token_id": [2, 300]})


@pytest.mark.parametrize("value,ok", [(None, True), ("float32", True), ("torch.float32", True),
                                      ("bfloat16", False), ("float16", False), ("auto", False), (32, False)])
def test_mamba_ssm_cache_dtype(value, ok):
    """The published configs keep the SSM state in float32 (``mamba_ssm_cache_dtype``), as the
    engine does; a checkpoint that wants it in another dtype is refused, naming the field."""
    d = {"model_type": "nemotron_h", "hybrid_override_pattern": "M*", "hidden_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_num_heads": 8, "n_groups": 2,
         "vocab_size": 256, "mamba_ssm_cache_dtype": value}
    if ok:
        assert ModelConfig.from_dict(d).hidden_size == 64
    else:
        with pytest.raises(ValueError, match=r"mamba_ssm_cache_dtype is .*allowed: 'float32'"):
            ModelConfig.from_dict(d)


# ---- quantized, corrupt and non-finite weights -------------------------------------------------

@pytest.mark.parametrize("dtype,code", [(torch.float8_e4m3fn, "F8_E4M3"), (torch.uint8, "U8"),
                                        (torch.int32, "I32")])
def test_non_float_tensor_named(base, tmp_path, dtype, code):
    d = _copy(base, tmp_path)
    name = "backbone.layers.1.mixer.q_proj.weight"
    _edit_tensors(d, lambda sd: {**sd, name: sd[name].to(dtype)})
    with pytest.raises(ValueError, match=rf"{name} \({code}, in model.safetensors\)"):
        LLM(d, dtype="float32", device="cpu")


def test_quantization_config_rejected(base, tmp_path):
    d = _copy(base, tmp_path)
    _edit_config(d, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method 'fp8', quant_algo None\) is not supported"):
        LLM(d, dtype="float32", device="cpu")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_safetensors_named(base, tmp_path, damage):
    d = _copy(base, tmp_path)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07garbage" * 100)
    with pytest.raises(ValueError, match=r"model.safetensors is not a valid safetensors file"):
        LLM(d, dtype="float32", device="cpu")


def test_missing_weights_and_config(base, tmp_path):
    d = _copy(base, tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors weight files"):
        LLM(d, dtype="float32", device="cpu")
    d2 = _copy(base, tmp_path, "m2")
    (d2 / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(d2, dtype="float32", device="cpu")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_tensor_named(base, tmp_path, value):
    d = _copy(base, tmp_path)
    name = "backbone.layers.4.mixer.gate.weight"

    def poison(sd):
        sd[name] = sd[name].clone()
        sd[name][1, 2] = value
        return sd
    _edit_tensors(d, poison)
    with pytest.raises(ValueError, match=rf"NaN or inf values in 1 tensor\(s\): {name}"):
        LLM(d, dtype="float32", device="cpu")


def test_huge_finite_tensor_is_not_flagged(base, tmp_path):
    from hybrid_engine.models.loader import check_finite
    m = torch.nn.Linear(4, 4)
    with torch.no_grad():
        m.weight.fill_(3e38)              # the float32 sum overflows; every value is finite
        m.bias[0] = float("nan")
    with pytest.raises(ValueError, match=r"1 tensor\(s\): disk.bias$"):
        check_finite(m, {"weight": "disk.weight", "bias": "disk.bias"}, tmp_path)


def test_invalid_tokenizer_named(base, tmp_path):
    d = _copy(base, tmp_path)
    (d / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"tokenizer in .* could not be loaded from .*tokenizer.json"):
        LLM(d, dtype="float32", device="cpu")


# ---- generation_config.json --------------------------------------------------------------------

def _gen_config(d, **kw):
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **kw}))


def test_eos_id_list_stops_on_any(base, ref, tmp_path):
    d = _copy(base, tmp_path)
    stop = ref[3]
    first = min(i for i, t in enumerate(ref) if t in (2, stop))
    _gen_config(d, eos_token_id=[2, stop])
    llm = LLM(d, dtype="float32", device="cpu", max_num_seqs=1)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:first + 1] and out.finish_reason == "stop"
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref


def test_sampling_defaults_and_user_params(base, ref, tmp_path):
    d = _copy(base, tmp_path)
    _gen_config(d, eos_token_id=2, do_sample=True, temperature=0.6, top_p=0.9, top_k=20, max_new_tokens=4)
    llm = LLM(d, dtype="float32", device="cpu", max_num_seqs=1)
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.6, 0.9, 20, 4)
    out = llm.generate([PROMPT], None, use_tqdm=False)[0].outputs[0]     # model defaults
    assert len(out.token_ids) == 4 or out.finish_reason == "stop"
    # an explicit SamplingParams is the user's on every field: greedy, 6 tokens
    out = llm.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref


def test_do_sample_false_and_max_length(base, tmp_path):
    d = _copy(base, tmp_path)
    _gen_config(d, do_sample=False, temperature=0.7, max_length=len(PROMPT) + 3)
    llm = LLM(d, dtype="float32", device="cpu", max_num_seqs=1)
    assert llm.get_default_sampling_params().temperature == 0.0
    out = llm.generate([PROMPT], None, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 or out.finish_reason == "stop"


@pytest.mark.parametrize("content,match", [
    ({"eos_token_id": [2, 999]}, r"eos_token_id=\[2, 999\] is invalid"),
    ({"temperature": -1}, "temperature=-1 is invalid"),
    ({"top_p": 0}, "top_p=0 is invalid"),
    ({"max_new_tokens": "5"}, "max_new_tokens='5' is invalid"),
    ("[1, 2]", "must hold a JSON object"),
    ("{oops", "is not valid JSON")])
def test_bad_generation_config_named(base, tmp_path, content, match):
    d = _copy(base, tmp_path)
    text = content if isinstance(content, str) else json.dumps(content)
    (d / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match="generation_config.json") as e:
        LLM(d, dtype="float32", device="cpu")
    assert e.match(match)


# ---- the default-model cache ------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncate_weights", "drop_tokenizer", "drop_manifest", "edit_config"])
def test_corrupt_default_model_cache_is_rebuilt(tmp_path, monkeypatch, damage):
    from hybrid_engine.default_model import cache_problem, default_model_dir
    monkeypatch.setenv("HYBRID_ENGINE_CACHE", str(tmp_path / "cache"))
    d = default_model_dir()
    assert cache_problem(d) is None
    good = (d / "model.safetensors").read_bytes()
    if damage == "truncate_weights":
        (d / "model.safetensors").write_bytes(good[:1000])
    elif damage == "drop_tokenizer":
        (d / "tokenizer.json").unlink()
    elif damage == "drop_manifest":
        (d / "manifest.json").unlink()
    else:
        _edit_config(d, hidden_size=96)
    assert cache_problem(d) is not None
    assert default_model_dir() == d
    assert cache_problem(d) is None and (d / "model.safetensors").read_bytes() == good
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")]


def test_model_prefix_with_merged_experts_and_mtp(tmp_path):
    """A model.* checkpoint with merged [E, F, D] experts and mtp.* tensors loads, MTP included,
    and decodes exactly like the backbone.* per-expert original."""
    import re
    src = make_hf_model(tmp_path / "src", pattern="M*E", seed=3, num_nextn_predict_layers=1)
    want = hf_greedy(src, [PROMPT], 5)[0]
    d = _copy(src, tmp_path, "merged")

    def merge(sd):
        out, groups = {}, {}
        for k, v in sd.items():
            m = re.match(r"^(backbone\..*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$", k)
            if m:
                groups.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = v
            else:
                out[k] = v
        for k, per in groups.items():
            out[k] = torch.stack([per[e] for e in sorted(per)])
        return rename_prefix(out, "model.")
    _edit_tensors(d, merge)
    names = load_file(str(d / "model.safetensors")).keys()
    assert "model.layers.2.mixer.experts.up_proj" in names and any(n.startswith("mtp.") for n in names)
    from hybrid_engine import SpeculativeConfig
    for spec in (None, SpeculativeConfig(method="mtp", num_speculative_tokens=2)):
        assert _greedy(d, max_tokens=5, speculative_config=spec).outputs[0].token_ids == want
