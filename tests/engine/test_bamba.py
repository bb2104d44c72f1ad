"""Bamba (model_type "bamba", hybrid_engine/models/bamba.py) served by the engine: exact greedy
equality with transformers float32 (O(1)-scale weights, RoPE on half of each head, q/k/v/o, MLP and
Mamba projection biases on), chunked prefill (a prompt longer than the 16-token budget), async
scheduling, n-gram and draft-model speculation, and clear errors for what is not implemented."""
import json

import pytest

import family_checks as fc
from hf_reference import hf_groups_the_gated_norm
from hybrid_engine.config import ATTENTION, MAMBA, ModelConfig
from hybrid_engine.models.synthetic import make_family_model

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, attn_layer_indices=[1, 3],
            num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=8,
            mamba_n_groups=2 if hf_groups_the_gated_norm("bamba") else 1, mamba_d_state=16,
            mamba_d_conv=4, mamba_chunk_size=16, attention_bias=True, mamba_proj_bias=True, mlp_bias=True)


@pytest.fixture(scope="module")
def bamba_dir(tmp_path_factory):
    return make_family_model(tmp_path_factory.mktemp("bamba") / "m", "bamba", seed=1, **TINY)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    tiny = dict(TINY, num_hidden_layers=2, attn_layer_indices=[1])
    return make_family_model(tmp_path_factory.mktemp("bamba_draft") / "m", "bamba", seed=2, **tiny)


@pytest.fixture(scope="module")
def ps():
    return fc.prompts(0)


@pytest.fixture(scope="module")
def ref(bamba_dir, ps):
    return fc.reference(bamba_dir, ps)


def test_config_maps_to_the_engine(bamba_dir):
    cfg = ModelConfig.from_json(bamba_dir)
    assert cfg.model_type == "bamba" and cfg.layer_types == (MAMBA, ATTENTION, MAMBA, ATTENTION)
    assert cfg.mamba_layer_ids == (0, 2) and cfg.attention_layer_ids == (1, 3)
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size) == (8, 16, TINY["mamba_n_groups"], 16)
    assert cfg.rotary_dim == 8 and cfg.rope_theta == 10000.0          # partial_rotary_factor 0.5 of 16


def test_prefill_logits_match_transformers(bamba_dir):
    fc.check_prefill_logits(bamba_dir)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_transformers(bamba_dir, ps, ref, async_scheduling):
    assert fc.engine_tokens(bamba_dir, ps, async_scheduling=async_scheduling) == ref


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_spec_decoding_equals_transformers(bamba_dir, draft_dir, ps, ref, method):
    got = fc.engine_tokens(bamba_dir, ps, async_scheduling=True, speculative_config=fc.spec(method, draft_dir))
    assert got == ref


def _cfg(bamba_dir, **changes):
    d = json.loads((bamba_dir / "config.json").read_text())
    d.update(changes)
    return d


@pytest.mark.parametrize("changes, key", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (dict(mamba_d_head=12), "mamba_d_head"),
    (dict(attn_layer_indices=[7]), "attn_layer_indices"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.1}), "partial_rotary_factor"),
])
def test_unsupported_options_are_clear_errors(bamba_dir, changes, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(_cfg(bamba_dir, **changes))


def test_mtp_is_refused(bamba_dir):
    from hybrid_engine import LLM, SpeculativeConfig
    with pytest.raises(ValueError, match="mtp"):
        LLM(bamba_dir, dtype="float32", device="cpu",
            speculative_config=SpeculativeConfig(method="mtp", num_speculative_tokens=1))


def test_legacy_style_config_parses():
    """Older Bamba configs: a top-level rope_theta and no rope_parameters (the half-head rotary is
    transformers' fixed Bamba value), attn_rotary_emb (ignored by transformers), torch_dtype."""
    d = {"architectures": ["BambaForCausalLM"], "model_type": "bamba", "attn_layer_indices": [2],
         "attn_rotary_emb": 16, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
         "num_attention_heads": 2, "num_key_value_heads": 1, "mamba_n_heads": 8, "mamba_d_head": 16,
         "mamba_d_state": 32, "mamba_n_groups": 1, "rope_theta": 5000.0, "torch_dtype": "bfloat16", "vocab_size": 300}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta == 5000.0 and cfg.rotary_dim == 16 and cfg.head_dim == 32
    assert cfg.layer_types == (MAMBA, MAMBA, ATTENTION, MAMBA)
