"""The test fixtures themselves: make_hf_model, the transformers references, the default model."""
import json
import threading

import pytest
import torch
from safetensors import safe_open

from hybrid_engine.config import ModelConfig
from hybrid_engine.models.synthetic import KIND_NAMES, TINY_TIME_STEP_MIN, make_hf_model
from hf_reference import hf_dt_values, hf_greedy, hf_logits, load_hf


def _prompts(n, vocab, seed=0, lengths=(5, 12, 23)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("fx") / "tiny", "M-M*-ME", seed=0)


def test_dt_never_below_time_step_min(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["time_step_min"] == TINY_TIME_STEP_MIN
    for prompt in _prompts(3, 256, seed=1, lengths=(40, 17, 64)):
        dt = hf_dt_values(tiny, prompt)
        assert dt.numel() == len(prompt) * 3 * 8
        assert (dt < cfg["time_step_min"]).float().mean().item() == 0.0
        assert dt.min().item() > 1e-5 and dt.max().item() < 2.0


def test_logit_scale_and_greedy_diversity(tiny):
    for prompt in _prompts(3, 256, seed=2):
        logits = hf_logits(tiny, prompt)
        assert logits.shape == (len(prompt), 256) and logits.dtype == torch.float32
        std = logits.std(-1).mean().item()
        assert 1.0 < std < 4.0, std
    outs = hf_greedy(tiny, _prompts(3, 256, seed=3), 16)
    for out in outs:
        assert len(out) == 16 and len(set(out)) >= 6, out


def test_hf_greedy_equals_full_recompute(tiny):
    # generate() decodes on the single-token path; a full forward uses the chunked path. They agree
    # because dt never reaches time_step_min (transformers clamps only on the chunked path).
    for prompt in _prompts(2, 256, seed=4, lengths=(7, 21)):
        ref = hf_greedy(tiny, [prompt], 10)[0]
        seq = list(prompt)
        for _ in range(10):
            seq.append(int(hf_logits(tiny, seq)[-1].argmax()))
        assert seq[len(prompt):] == ref


def test_mtp_tensors_written(tmp_path):
    d = make_hf_model(tmp_path / "mtp", "M*E", num_nextn_predict_layers=1, n_routed_experts=3,
                      dtype=torch.bfloat16, seed=2)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    D = 64
    assert shapes["mtp.layers.0.enorm.weight"] == (D,) and shapes["mtp.layers.0.hnorm.weight"] == (D,)
    assert shapes["mtp.layers.0.eh_proj.weight"] == (D, 2 * D)
    assert shapes["mtp.layers.0.norm.weight"] == (D,) and shapes["mtp.layers.0.mixer.q_proj.weight"] == (64, D)
    assert shapes["mtp.layers.1.final_layernorm.weight"] == (D,)
    assert shapes["mtp.layers.1.mixer.experts.2.up_proj.weight"] == (64, D)
    assert shapes["mtp.layers.1.mixer.gate.e_score_correction_bias"] == (3,)
    assert "mtp.layers.1.enorm.weight" not in shapes and "mtp.layers.0.final_layernorm.weight" not in shapes
    assert dtypes["mtp.layers.0.eh_proj.weight"] == "BF16" and dtypes["backbone.embeddings.weight"] == "BF16"
    assert dtypes["mtp.layers.1.mixer.gate.e_score_correction_bias"] == "F32"
    assert dtypes["backbone.layers.2.mixer.gate.e_score_correction_bias"] == "F32"
    mc = ModelConfig.from_json(d)
    assert mc.num_nextn_predict_layers == 1 and mc.mtp_layer_types == ("*", "E") and mc.torch_dtype == "bfloat16"
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        eh = f.get_tensor("mtp.layers.0.eh_proj.weight").float()
    assert 0.5 < eh.std().item() * (2 * D) ** 0.5 < 2.0       # O(1) init, N(0, 1/fan_in)
    # transformers ignores the mtp.* tensors
    assert len(hf_greedy(d, [[5, 6, 7]], 4)[0]) == 4


def test_hf_scale_and_tokenizer(tmp_path):
    d = make_hf_model(tmp_path / "tok", "M*", vocab_size=300, scale="hf", with_tokenizer=True)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) <= 300 and tok.eos_token_id == 2
    assert load_hf(d).lm_head.weight.std().item() < 0.05
    with pytest.raises(ValueError, match="vocab_size"):
        make_hf_model(tmp_path / "small", "M", with_tokenizer=True)
    with pytest.raises(ValueError, match="pattern"):
        make_hf_model(tmp_path / "bad", "MX")


def test_default_model_dir(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    from hybrid_engine.default_model import default_config, default_model_dir

    monkeypatch.setenv("HYBRID_ENGINE_CACHE", str(tmp_path / "cache"))
    results = []
    threads = [threading.Thread(target=lambda: results.append(default_model_dir())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0] == results[1]
    d = results[0]
    assert d.parent == tmp_path / "cache" and d.name.startswith("default-")
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [d.name]      # temp folders cleaned up
    assert default_model_dir() == d
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (d / name).is_file(), name

    mc = ModelConfig.from_json(d)
    cfg = default_config()
    names = {v: k for k, v in KIND_NAMES.items()}
    assert mc.vocab_size == cfg["vocab_size"]
    assert "".join(mc.layer_types) == "".join(names[k] for k in cfg["layers_block_type"])
    assert set(mc.layer_types) == set("M*-E") and mc.num_nextn_predict_layers == 1    # every kind, and MTP
    tok = AutoTokenizer.from_pretrained(d)
    assert len(tok) == mc.vocab_size
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "The river begins as a thin line of water, 42 times! Ünïcode too."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < mc.vocab_size
    assert len(hf_greedy(d, [ids], 3)[0]) == 3


def test_synthetic_model_dir(tmp_path, monkeypatch):
    """The seeded synthetic model (random O(1)-scale weights) keeps its shapes for the tests."""
    from hybrid_engine.default_model import default_model_dir, synthetic_config, synthetic_model_dir

    monkeypatch.setenv("HYBRID_ENGINE_CACHE", str(tmp_path / "cache"))
    d = synthetic_model_dir()
    assert d.name.startswith("synthetic-") and synthetic_model_dir() == d and d != default_model_dir()
    mc = ModelConfig.from_json(d)
    cfg = synthetic_config()
    assert mc.vocab_size == cfg["vocab_size"] and "".join(mc.layer_types) == cfg["pattern"]
    assert mc.hidden_size == cfg["hidden_size"] and len(mc.mtp_layer_types) == len(cfg["mtp_pattern"])
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert any(k.startswith("mtp.") for k in f.keys())
    assert load_hf(d).lm_head.weight.std().item() > 0.1          # sens init, not a trained model
