"""IBM Granite-4.0-H (model_type "granitemoehybrid", hybrid_engine/models/granitemoehybrid.py) served
by the engine: exact greedy equality with transformers float32 (O(1)-scale weights; softmax top-k
router, SwiGLU experts with merged gate/up weights, shared MLP; every Granite multiplier away from
1; RoPE on and off; the dense variant without experts; tied embeddings), chunked prefill, async
scheduling, n-gram and draft-model speculation, clear errors for what is not implemented, and
bfloat16 prefill logits as close to float32 as transformers' own bfloat16 run."""
import json
from unittest import mock

import numpy as np
import pytest
import torch

import family_checks as fc
from hf_reference import hf_groups_the_gated_norm
from hybrid_engine.config import ATTENTION, MAMBA, ModelConfig
from hybrid_engine.models.synthetic import make_family_model

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=4,
            layer_types=["mamba", "attention", "mamba", "attention"], num_attention_heads=4, num_key_value_heads=2,
            mamba_n_heads=8,
            mamba_n_groups=2 if hf_groups_the_gated_norm("granitemoehybrid") else 1, mamba_d_state=16, mamba_chunk_size=16, num_local_experts=4,
            num_experts_per_tok=2, position_embedding_type="rope", embedding_multiplier=1.5,
            residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=0.8)


@pytest.fixture(scope="module")
def make(tmp_path_factory):
    root, cache = tmp_path_factory.mktemp("granite"), {}

    def get(name, seed=1, **changes):
        if name not in cache:
            cache[name] = make_family_model(root / name, "granitemoehybrid", seed=seed, **dict(TINY, **changes))
        return cache[name]
    return get


@pytest.fixture(scope="module")
def ps():
    return fc.prompts(2)


@pytest.fixture(scope="module")
def ref(make, ps):
    return fc.reference(make("main"), ps)


def test_config_maps_to_the_engine(make):
    cfg = ModelConfig.from_json(make("main"))
    assert cfg.model_type == "granitemoehybrid" and cfg.layer_types == (MAMBA, ATTENTION, MAMBA, ATTENTION)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_router, cfg.moe_activation) == (4, 2, "softmax", "swiglu")
    assert cfg.attention_scale == 0.3 and cfg.rotary_dim == 16
    assert cfg.family.residual_multiplier == 0.7 and cfg.family.logits_scaling == 0.8


@pytest.mark.parametrize("name, changes", [
    ("main", {}),
    ("nope_dense_tied", dict(position_embedding_type="nope", num_local_experts=0, tie_word_embeddings=True)),
    ("null_position_embedding", dict(position_embedding_type=None, num_experts_per_tok=1)),
])
def test_prefill_logits_match_transformers(make, name, changes):
    fc.check_prefill_logits(make(name, **changes))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_transformers(make, ps, ref, async_scheduling):
    assert fc.engine_tokens(make("main"), ps, async_scheduling=async_scheduling) == ref


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_spec_decoding_equals_transformers(make, ps, ref, method):
    draft = make("draft", seed=2, num_hidden_layers=2, layer_types=["mamba", "attention"])
    got = fc.engine_tokens(make("main"), ps, async_scheduling=True, speculative_config=fc.spec(method, draft))
    assert got == ref


def bf16_errors_routed_as_float32(model_dir, ids: list[int], device: str = "cpu") -> tuple[float, float]:
    """(ours, transformers'): max|bf16 logits - float32 transformers logits| / max|float32 logits|
    of one prefill of ``ids``, with every MoE layer of both bf16 runs routed to the experts that
    the float32 run chose (routing weights still from each run's own router logits). Where two
    router logits lie closer than bf16 resolves, any bf16 run, ours or transformers', may pick
    either expert, which moves that token's logits by 5-25%: which run draws such a flip on a
    given prompt is chance (both flip equally often over many prompts), so a comparison of one
    prompt's unforced errors measures that draw, not numerics."""
    from hf_reference import engine_prefill_hidden, hf_logits, load_hf
    from transformers import AutoModelForCausalLM

    import hybrid_engine.models.granitemoehybrid as granite
    from hybrid_engine import LLM
    from hybrid_engine.models.synthetic import _quiet_transformers

    def roles(out) -> tuple[int, int, int]:
        """Positions of (router logits [T, E], top-k weights [T, k], top-k index [T, k]) in the
        router's output: transformers 5.24 returns them in that order, 5.17 as (index, weights,
        logits)."""
        index = next(i for i, t in enumerate(out) if not t.is_floating_point())
        floats = [i for i, t in enumerate(out) if t.is_floating_point()]
        logits = max(floats, key=lambda i: out[i].shape[-1])
        return logits, next(i for i in floats if i != logits), index

    choices: list[torch.Tensor] = []                    # [T, k] experts of each layer, float32 run
    hooks = [layer.block_sparse_moe.router.register_forward_hook(
        lambda _m, _a, out: choices.append(out[roles(out)[2]])) for layer in load_hf(model_dir).model.layers]
    try:
        ref = hf_logits(model_dir, ids)
    finally:
        for h in hooks:
            h.remove()

    def hf_router(_m, args, out):                      # transformers' router with the experts given
        i_logits, i_weights, i_index = roles(out)
        idx = next(hf_forced).to(out[i_logits].device, out[i_index].dtype)
        forced = list(out)
        forced[i_index] = idx
        forced[i_weights] = torch.softmax(out[i_logits].gather(1, idx.long()), dim=-1).type_as(args[0])
        return tuple(forced)

    def our_route(logits, bias, spec, counts=None, valid=None):   # moe_ops.route with the experts given
        idx = next(our_forced).to(logits.device)
        return idx.to(torch.int32), torch.softmax(logits.float().gather(1, idx), dim=-1) * spec.scale

    with _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    for layer in model.model.layers:
        layer.block_sparse_moe.router.register_forward_hook(hf_router)
    hf_forced = iter(choices)
    with torch.no_grad(), _quiet_transformers():
        theirs = model(torch.tensor([ids], device=device), use_cache=False).logits[0].float().cpu()
    llm = LLM(model_dir, dtype="bfloat16", device=device, max_num_seqs=2)
    our_forced = iter(choices)
    with torch.inference_mode(), mock.patch.object(granite, "route", our_route):
        ours = llm.engine.model.compute_logits(engine_prefill_hidden(llm, ids)).float().cpu()
    assert next(hf_forced, None) is None and next(our_forced, None) is None   # every layer routed
    scale = ref.abs().max().item()
    return (ours - ref).abs().max().item() / scale, (theirs - ref).abs().max().item() / scale


def test_bf16_prefill_logits_as_close_as_transformers_bf16(make):
    """Our bfloat16 numerics (multipliers, norms, residual stream, Mamba, attention, router weights,
    experts) lose no more than transformers' bfloat16 run does, both against transformers float32,
    routed as float32 (``bf16_errors_routed_as_float32``)."""
    ids = np.random.default_rng(2).integers(3, 256, 41).tolist()
    ours, theirs = bf16_errors_routed_as_float32(make("main"), ids)
    assert 0 < theirs < 0.05 and ours <= 1.5 * theirs + 0.002, (ours, theirs)


def test_expert_load_is_counted(make):
    from hybrid_engine import LLM, SamplingParams
    llm = LLM(make("main"), dtype="float32", device="cpu", max_num_seqs=2)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    load = llm.stats()["moe_expert_tokens"]
    assert len(load) == 4 and all(sum(v) == 2 * (4 + 2) for v in load.values())   # top-2 of 6 tokens


@pytest.mark.parametrize("changes, key", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(position_embedding_type="alibi"), "position_embedding_type"),
    (dict(layer_types=["mamba", "moe", "mamba", "attention"]), "layer_types"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}), "rope_type"),
    (dict(num_local_experts=-1), "num_local_experts"),
    (dict(logits_scaling=0), "logits_scaling"),
    (dict(normalization_function="layernorm"), "normalization_function"),
])
def test_unsupported_options_are_clear_errors(make, changes, key):
    d = json.loads((make("main") / "config.json").read_text())
    d.update(changes)
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(d)


def test_published_style_dense_config_parses():
    """The keys of the published Granite-4.0-H configs (hand-written here at reduced width, not a
    copy): "nope" positional encoding, a dense model with num_local_experts = num_experts_per_tok = 0,
    normalization_function, rope_scaling null, torch_dtype, no mamba_expand."""
    d = {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
         "attention_bias": False, "attention_multiplier": 0.015625, "embedding_multiplier": 12, "eos_token_id": 100,
         "hidden_act": "silu", "hidden_size": 96, "intermediate_size": 128, "logits_scaling": 3,
         "layer_types": ["mamba", "mamba", "attention", "mamba"], "mamba_conv_bias": True, "mamba_d_conv": 4,
         "mamba_d_head": 16, "mamba_d_state": 32, "mamba_n_groups": 1, "mamba_n_heads": 12, "mamba_proj_bias": False,
         "max_position_embeddings": 32768, "normalization_function": "rmsnorm", "num_attention_heads": 6,
         "num_experts_per_tok": 0, "num_hidden_layers": 4, "num_key_value_heads": 2, "num_local_experts": 0,
         "position_embedding_type": "nope", "residual_multiplier": 0.246, "rms_norm_eps": 1e-05, "rope_scaling": None,
         "rope_theta": 10000, "shared_intermediate_size": 128, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
         "vocab_size": 128}
    cfg = ModelConfig.from_dict(d)
    assert cfg.rope_theta is None and not cfg.family.has_experts and cfg.tie_word_embeddings
    assert cfg.mamba_intermediate == 2 * 96 and cfg.attention_layer_ids == (2,) and cfg.torch_dtype == "bfloat16"
    assert ModelConfig.from_dict({k: v for k, v in d.items() if k != "model_type"}).model_type == "granitemoehybrid"
