"""Falcon-H1 (model_type "falcon_h1", hybrid_engine/models/falcon_h1.py) served by the engine: exact
greedy equality with transformers float32 (O(1)-scale weights; Mamba2 and attention in parallel in
every layer; every muP multiplier away from 1; the three Mamba gate/norm variants; mamba_d_ssm
narrower than expand x hidden; biases), chunked prefill, async scheduling, n-gram and draft-model
speculation, and clear errors for what is not implemented."""
import json

import pytest

import family_checks as fc
from hybrid_engine.config import HYBRID, ModelConfig
from hybrid_engine.models.synthetic import make_family_model

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2,
            mamba_d_state=16, mamba_chunk_size=16, mamba_rms_norm=False, projectors_bias=True, attention_bias=True,
            embedding_multiplier=1.3, lm_head_multiplier=0.7, key_multiplier=0.8, attention_in_multiplier=0.9,
            attention_out_multiplier=1.1, ssm_in_multiplier=1.2, ssm_out_multiplier=0.6,
            ssm_multipliers=[1.1, 0.9, 0.8, 1.2, 0.7], mlp_multipliers=[0.8, 1.25])


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("falcon"), {}

    def get(name, seed=1, **changes):
        if name not in cache:
            cache[name] = make_family_model(root / name, "falcon_h1", seed=seed, **dict(TINY, **changes))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def ps():
    return fc.prompts(3)


@pytest.fixture(scope="module")
def ref(make, ps):
    return fc.reference(make("main"), ps)


def test_config_maps_to_the_engine(make):
    cfg = ModelConfig.from_json(make("main"))
    assert cfg.model_type == "falcon_h1" and cfg.layer_types == (HYBRID,) * 3
    assert cfg.mamba_layer_ids == (0, 1, 2) and cfg.attention_layer_ids == (0, 1, 2)   # one of each per layer
    assert cfg.mamba_intermediate == 96 and cfg.conv_dim == 96 + 2 * 2 * 16 and cfg.rotary_dim == 16
    assert cfg.family.mamba_gate_mode == "gate_only" and cfg.family.ssm_multipliers[4] == 0.7


@pytest.mark.parametrize("name, changes", [
    ("main", {}),
    ("norm_before_gate", dict(mamba_rms_norm=True, mamba_norm_before_gate=True)),
    ("norm_after_gate", dict(mamba_rms_norm=True, mamba_norm_before_gate=False, tie_word_embeddings=True)),
])
def test_prefill_logits_match_transformers(make, name, changes):
    fc.check_prefill_logits(make(name, **changes))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_transformers(make, ps, ref, async_scheduling):
    assert fc.engine_tokens(make("main"), ps, async_scheduling=async_scheduling) == ref


def test_greedy_equals_transformers_with_the_norm_before_gate(make, ps):
    d = make("norm_before_gate", mamba_rms_norm=True, mamba_norm_before_gate=True)
    assert fc.engine_tokens(d, ps, async_scheduling=True) == fc.reference(d, ps)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_spec_decoding_equals_transformers(make, ps, ref, method):
    draft = make("draft", seed=2, num_hidden_layers=1)
    got = fc.engine_tokens(make("main"), ps, async_scheduling=True, speculative_config=fc.spec(method, draft))
    assert got == ref


@pytest.mark.parametrize("changes, key", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    (dict(ssm_multipliers=[1.0, 1.0]), "ssm_multipliers"),
    (dict(mlp_multipliers="1,1"), "mlp_multipliers"),
    (dict(mamba_d_head=10), "mamba_d_head"),
    (dict(mamba_rms_norm="yes"), "mamba_rms_norm"),
])
def test_unsupported_options_are_clear_errors(make, changes, key):
    d = json.loads((make("main") / "config.json").read_text())
    d.update(changes)
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(d)


def test_published_style_config_parses():
    """Keys of the published Falcon-H1 configs (hand-written at reduced width, not a copy): an
    explicit head_dim, mamba_d_ssm, top-level rope_theta, keys transformers ignores
    (mamba_use_mlp, mlp_expansion_factor), torch_dtype."""
    d = {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", "attention_in_multiplier": 1.0,
         "attention_out_multiplier": 0.9375, "embedding_multiplier": 5.66, "head_dim": 16, "hidden_act": "silu",
         "hidden_size": 64, "intermediate_size": 128, "key_multiplier": 0.39, "lm_head_multiplier": 0.039,
         "mamba_chunk_size": 128, "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_head": 16, "mamba_d_ssm": 96,
         "mamba_d_state": 32, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 6,
         "mamba_norm_before_gate": False, "mamba_proj_bias": False, "mamba_rms_norm": False, "mamba_use_mlp": True,
         "mlp_bias": False, "mlp_expansion_factor": 8, "mlp_multipliers": [0.88, 0.59], "num_attention_heads": 8,
         "num_hidden_layers": 4, "num_key_value_heads": 2, "projectors_bias": False, "rms_norm_eps": 1e-05,
         "rope_scaling": None, "rope_theta": 1e11, "ssm_in_multiplier": 1.25,
         "ssm_multipliers": [0.35, 0.25, 0.35, 0.5, 0.35], "ssm_out_multiplier": 0.236, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16", "vocab_size": 300}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 1e11 and cfg.rotary_dim == 16 and cfg.mamba_intermediate == 96
    assert cfg.family.mamba_gate_mode == "gate_only" and cfg.family.key_multiplier == 0.39
