"""ModelConfig parsing (every config.json form) and the engine-side config dataclasses."""
import json
import logging
import math

import pytest
import torch

from hybrid_engine.config import (ATTENTION, MAMBA, MLP, MOE, CacheConfig, EngineConfig, ModelConfig,
                                  SchedulerConfig, SpeculativeConfig, resolve_device, resolve_dtype)

HUB_STYLE = """{
  "architectures": ["NemotronHForCausalLM"],
  "model_type": "nemotron_h",
  "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4,
  "hybrid_override_pattern": "M-*E",
  "mtp_hybrid_override_pattern": "*-",
  "num_nextn_predict_layers": 1,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "intermediate_size": 128, "mlp_hidden_act": "relu2",
  "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
  "mamba_n_groups": 2, "mamba_d_conv": 3, "mamba_expand": 2, "mamba_chunk_size": 32,
  "mamba_dt_min": 0.0001, "mamba_dt_max": 0.1, "mamba_dt_limit": [0.0, Infinity],
  "mamba_conv_bias": false,
  "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
  "moe_shared_expert_intermediate_size": 48, "routed_scaling_factor": 2.5,
  "torch_dtype": "bfloat16",
  "eos_token_id": [2, 11], "bos_token_id": 1, "pad_token_id": 0,
  "tie_word_embeddings": false
}"""

BASE = {"model_type": "nemotron_h", "vocab_size": 100, "hidden_size": 32, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "mamba_num_heads": 4,
        "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8, "layers_block_type": ["linear_attention", "mlp"]}


def _write(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    return tmp_path


def test_transformers_save_pretrained_round_trip(tmp_path):
    from hybrid_engine.models.synthetic import hf_config

    cfg = hf_config("M-M*-ME", vocab_size=200, hidden_size=48, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=12, intermediate_size=96, mamba_num_heads=6, mamba_head_dim=8, n_groups=3,
                    ssm_state_size=10, conv_kernel=3, chunk_size=24, n_routed_experts=6, num_experts_per_tok=3,
                    moe_intermediate_size=20, moe_shared_expert_intermediate_size=30, n_group=2, topk_group=1,
                    time_step_min=1e-7, num_nextn_predict_layers=1, mtp_pattern="*E", eos_token_id=[2, 5],
                    tie_word_embeddings=True)
    cfg.save_pretrained(tmp_path)
    raw = (tmp_path / "config.json").read_text()
    assert '"__float__": "Infinity"' in raw and "layers_block_type" in raw
    mc = ModelConfig.from_json(tmp_path)
    assert mc.layer_types == (MAMBA, MLP, MAMBA, ATTENTION, MLP, MAMBA, MOE)
    assert mc.num_layers == 7 and mc.mamba_layer_ids == (0, 2, 5) and mc.attention_layer_ids == (3,)
    assert mc.time_step_limit == (0.0, math.inf)
    assert mc.time_step_min == 1e-7
    assert mc.mtp_layer_types == (ATTENTION, MOE) and mc.num_nextn_predict_layers == 1
    assert mc.eos_token_id == (2, 5) and mc.tie_word_embeddings
    assert mc.torch_dtype is None    # a bare config has no dtype; save_pretrained of a model writes one
    for name in ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "intermediate_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                 "conv_kernel", "chunk_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "moe_shared_expert_intermediate_size", "n_group", "topk_group", "layer_norm_epsilon"):
        assert getattr(mc, name) == getattr(cfg, name), name
    assert mc.mamba_intermediate == 48 and mc.conv_dim == 48 + 2 * 3 * 10


def test_hub_style_legacy_config_bare_infinity(tmp_path):
    from transformers import NemotronHConfig

    mc = ModelConfig.from_json(_write(tmp_path, HUB_STYLE) / "config.json")
    assert mc.layer_types == (MAMBA, MLP, ATTENTION, MOE)
    assert mc.mtp_layer_types == (ATTENTION, MLP)
    assert mc.n_groups == 2 and mc.conv_kernel == 3 and mc.chunk_size == 32
    assert mc.time_step_min == 1e-4 and mc.time_step_limit == (0.0, math.inf)
    assert mc.use_conv_bias is False
    assert mc.eos_token_id == (2, 11) and mc.torch_dtype == "bfloat16"
    assert mc.moe_shared_expert_intermediate_size == 48 and mc.routed_scaling_factor == 2.5
    # transformers reads the same file the same way
    hf = NemotronHConfig(**json.loads(HUB_STYLE))
    assert hf.n_groups == mc.n_groups and hf.conv_kernel == mc.conv_kernel and hf.chunk_size == mc.chunk_size
    assert hf.time_step_min == mc.time_step_min and hf.use_conv_bias == mc.use_conv_bias
    assert hf.hybrid_override_pattern == "".join(mc.layer_types)
    assert hf.mtp_hybrid_override_pattern == "".join(mc.mtp_layer_types)


def test_layer_types_alias_and_legacy_kind_names():
    d = dict(BASE, layers_block_type=None, layer_types=["mamba", "attention", "moe", "mlp"])
    assert ModelConfig.from_dict(d).layer_types == (MAMBA, ATTENTION, MOE, MLP)
    # layers_block_type wins over the legacy pattern (as in transformers)
    d = dict(BASE, hybrid_override_pattern="***")
    assert ModelConfig.from_dict(d).layer_types == (MAMBA, MLP)


@pytest.mark.parametrize("limit, expected", [
    ([0.0, {"__float__": "Infinity"}], (0.0, math.inf)),
    ([{"__float__": "-Infinity"}, {"__float__": "Infinity"}], (-math.inf, math.inf)),
    ([0.001, 0.5], (0.001, 0.5)),
])
def test_special_float_forms(limit, expected):
    assert ModelConfig.from_dict(dict(BASE, time_step_limit=limit)).time_step_limit == expected


def test_bare_special_literals_and_nan_decoding(tmp_path):
    from hybrid_engine._config_parse import decode_special_floats

    text = json.dumps(dict(BASE, time_step_limit=[0.0, 1.0])).replace("1.0]", "Infinity]")
    assert "Infinity]" in text
    assert ModelConfig.from_json(_write(tmp_path, text)).time_step_limit == (0.0, math.inf)
    out = decode_special_floats({"a": [{"__float__": "NaN"}, {"__float__": "-Infinity"}], "b": {"c": 1}})
    assert math.isnan(out["a"][0]) and out["a"][1] == -math.inf and out["b"] == {"c": 1}
    with pytest.raises(ValueError, match="time_step_limit"):
        ModelConfig.from_dict(dict(BASE, time_step_limit=[0.0, {"__float__": "NaN"}]))
    with pytest.raises(ValueError, match="__float__"):
        decode_special_floats({"__float__": "Huge"})


@pytest.mark.parametrize("eos, expected", [(2, (2,)), ([2, 7], (2, 7)), (None, ())])
def test_eos_forms(eos, expected):
    assert ModelConfig.from_dict(dict(BASE, eos_token_id=eos)).eos_token_id == expected


def test_defaults_and_dtype_key():
    d = {k: v for k, v in BASE.items() if k not in ("num_key_value_heads", "head_dim")}
    d.update(num_key_value_heads=None, head_dim=None, dtype="torch.float16")
    mc = ModelConfig.from_dict(d)
    assert mc.num_key_value_heads == 4 and mc.head_dim == 8 and mc.torch_dtype == "float16"
    assert mc.time_step_limit == (0.0, math.inf) and mc.mtp_layer_types == (ATTENTION, MOE)


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_json(tmp_path)
    _write(tmp_path, "{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_json(tmp_path)
    _write(tmp_path, "[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        ModelConfig.from_json(tmp_path)


def test_model_type_errors():
    with pytest.raises(ValueError, match=r"'llama'.*supported: 'nemotron_h'"):
        ModelConfig.from_dict(dict(BASE, model_type="llama"))
    with pytest.raises(ValueError, match="model_type None"):
        ModelConfig.from_dict({k: v for k, v in BASE.items() if k != "model_type"})


def test_unknown_layer_kind_names_index_and_allowed():
    with pytest.raises(ValueError, match=r"layers_block_type\[1\] \(layer 1\).*'rnn'.*linear_attention"):
        ModelConfig.from_dict(dict(BASE, layers_block_type=["mlp", "rnn"]))
    d = {k: v for k, v in BASE.items() if k != "layers_block_type"}
    with pytest.raises(ValueError, match=r"hybrid_override_pattern\[2\] \(layer 2\).*'X'.*'M'"):
        ModelConfig.from_dict(dict(d, hybrid_override_pattern="M-X"))
    with pytest.raises(ValueError, match=r"mtp_layers_block_type\[0\]"):
        ModelConfig.from_dict(dict(BASE, mtp_layers_block_type=["foo"]))


def test_num_hidden_layers_mismatch_only_warns(caplog):
    with caplog.at_level(logging.WARNING):
        mc = ModelConfig.from_dict(dict(BASE, num_hidden_layers=5))
    assert mc.num_layers == 2
    assert "num_hidden_layers" in caplog.text


@pytest.mark.parametrize("field, value", [
    ("hidden_size", "big"), ("vocab_size", 0), ("mamba_num_heads", -1), ("use_conv_bias", "yes"),
    ("layer_norm_epsilon", "x"), ("pad_token_id", -3), ("eos_token_id", "eos"), ("time_step_limit", [1.0]),
    ("mlp_hidden_act", "gelu"), ("moe_latent_size", 0),
])
def test_bad_field_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(dict(BASE, **{field: value}))


def test_inconsistent_shapes():
    with pytest.raises(ValueError, match="n_groups"):
        ModelConfig.from_dict(dict(BASE, n_groups=3))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_dict(dict(BASE, num_key_value_heads=3, layers_block_type=["full_attention"]))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_dict(dict(BASE, layers_block_type=["moe"], n_routed_experts=2, num_experts_per_tok=3))


def test_cache_and_scheduler_configs():
    assert CacheConfig().block_size == 16 and CacheConfig().num_kv_blocks is None
    assert CacheConfig().kv_cache_bytes == 256 * 2**20 and CacheConfig().kv_cache_memory_fraction == 0.5
    for kw, field in [({"block_size": 0}, "block_size"), ({"num_kv_blocks": 1}, "num_kv_blocks"),
                      ({"kv_cache_memory_fraction": 1.5}, "kv_cache_memory_fraction"),
                      ({"kv_cache_bytes": 0}, "kv_cache_bytes")]:
        with pytest.raises(ValueError, match=field):
            CacheConfig(**kw)
    s = SchedulerConfig()
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.max_model_len) == (64, 2048, None)
    for kw, field in [({"max_num_seqs": 0}, "max_num_seqs"), ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
                      ({"max_model_len": 0}, "max_model_len"), ({"max_num_seqs": 2.5}, "max_num_seqs")]:
        with pytest.raises(ValueError, match=rf"{field}.*>= 1"):
            SchedulerConfig(**kw)


def test_speculative_config_validation():
    s = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert (s.prompt_lookup_min, s.prompt_lookup_max, s.model) == (1, 4, None)
    SpeculativeConfig(method="draft_model", num_speculative_tokens=8, model="/some/dir")
    SpeculativeConfig(method="mtp", num_speculative_tokens=1)
    cases = [
        (dict(method="medusa", num_speculative_tokens=2), r"method.*'ngram', 'draft_model', 'mtp'"),
        (dict(method="ngram", num_speculative_tokens=0), r"num_speculative_tokens.*\[1, 8\]"),
        (dict(method="ngram", num_speculative_tokens=9), r"num_speculative_tokens.*\[1, 8\]"),
        (dict(method="draft_model", num_speculative_tokens=2), "model"),
        (dict(method="ngram", num_speculative_tokens=2, model="x"), "model"),
        (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
        (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2),
         "prompt_lookup_max"),
    ]
    for kw, pat in cases:
        with pytest.raises(ValueError, match=pat):
            SpeculativeConfig(**kw)


def test_resolve_dtype_and_device():
    mc = ModelConfig.from_dict(BASE)
    assert resolve_dtype("auto", mc, "cpu") == torch.float32
    assert resolve_dtype("auto", mc, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", ModelConfig.from_dict(dict(BASE, torch_dtype="bfloat16")), "cpu") == torch.bfloat16
    assert resolve_dtype("float16", mc) == torch.float16 and resolve_dtype(torch.bfloat16, mc) == torch.bfloat16
    with pytest.raises(ValueError, match=r"dtype.*'auto', 'float32', 'bfloat16' or 'float16'.*int8"):
        resolve_dtype("int8", mc)
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_engine_config_resolve(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, num_nextn_predict_layers=0)))
    ec = EngineConfig.resolve(tmp_path, dtype="auto", device="cpu", max_num_seqs=4,
                              speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    assert ec.model.vocab_size == 100 and ec.dtype == torch.float32 and ec.device == torch.device("cpu")
    assert ec.scheduler.max_num_seqs == 4 and ec.speculative.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="MTP"):
        EngineConfig.resolve(tmp_path, device="cpu",
                             speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=1))
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.resolve(tmp_path, device="cpu", block_size=0)
