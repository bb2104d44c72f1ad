"""MoE at the published Nemotron 3 shapes, reduced: greedy output equals transformers (float32,
O(1)-scale weights) on copies of NVIDIA-Nemotron-3-Nano-30B-A3B and Nemotron-3-Super-120B-A12B
that keep the exact layer pattern, expert count, top-k, router settings, scaling factor, latent
MoE and MTP pattern, with widths and vocab shrunk so a CPU run takes seconds. Prompts are longer
than one 128-token SSD chunk and run through chunked prefill, preemption and async scheduling;
the Super copy also decodes with its MoE-bearing MTP block."""
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hf_reference import hf_greedy, load_hf
from hybrid_engine.models.synthetic import KIND_NAMES

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")

# published values (config.json of each checkpoint) that the reduced copies keep
NANO = dict(pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", n_routed_experts=128,
            num_experts_per_tok=6, routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True,
            chunk_size=128, num_attention_heads=32, num_key_value_heads=2)
SUPER = dict(pattern="MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
             n_routed_experts=512, num_experts_per_tok=22, routed_scaling_factor=5.0, n_group=1, topk_group=1,
             norm_topk_prob=True, chunk_size=128, num_attention_heads=32, num_key_value_heads=2,
             num_nextn_predict_layers=1, mtp_pattern="*E")
# widths: published Nano hidden 2688, experts 1856, shared 3712, Mamba 64 x 64 heads, state 128;
# Super hidden 4096, latent 1024, experts 2688, shared 5376
SMALL = dict(vocab_size=256, hidden_size=32, head_dim=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
             ssm_state_size=8, moe_intermediate_size=16, moe_shared_expert_intermediate_size=32)


@pytest.fixture(scope="module")
def nano_dir(tmp_path_factory):
    from hybrid_engine.models.synthetic import make_hf_model
    return make_hf_model(tmp_path_factory.mktemp("nano") / "m", seed=11, **NANO, **SMALL)


@pytest.fixture(scope="module")
def super_dir(tmp_path_factory):
    from hybrid_engine.models.synthetic import make_hf_model
    return make_hf_model(tmp_path_factory.mktemp("super") / "m", seed=12, moe_latent_size=8, **SUPER, **SMALL)


def _prompts(n, lens, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, lens[i % len(lens)]).tolist() for i in range(n)]


@pytest.mark.slow
def test_reduced_copies_keep_the_published_moe_shape(nano_dir, super_dir):
    for d, want in ((nano_dir, NANO), (super_dir, SUPER)):
        cfg = load_hf(d).config
        symbol = {name: sym for sym, name in KIND_NAMES.items()}
        assert "".join(symbol[t] for t in cfg.layers_block_type) == want["pattern"]
        assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.routed_scaling_factor) == (
            want["n_routed_experts"], want["num_experts_per_tok"], want["routed_scaling_factor"])
    assert load_hf(super_dir).config.moe_latent_size == 8
    assert load_hf(nano_dir).config.moe_latent_size is None


@pytest.fixture(scope="module")
def nano_ref(nano_dir):
    """The Nano prompts and transformers' greedy continuations (the same for both scheduling modes)."""
    prompts = _prompts(4, [150, 7, 131, 40], seed=5)
    return prompts, hf_greedy(nano_dir, prompts, max_new_tokens=8)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_nano_greedy_equals_transformers(nano_dir, nano_ref, async_scheduling):
    prompts, ref = nano_ref
    # chunked prefill (64-token budget < 150-token prompt), preemption (few KV blocks)
    llm = LLM(nano_dir, dtype="float32", device=DEV, max_num_seqs=3, max_num_batched_tokens=64,
              block_size=16, num_kv_blocks=22, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    load = llm.stats()["moe_expert_tokens"]
    assert len(load) == NANO["pattern"].count("E")
    per_layer = [sum(v) for v in load.values()]
    # every real token (prompt + generated, recomputed after preemption) routes to 6 experts
    assert len(set(per_layer)) == 1 and per_layer[0] % 6 == 0 and per_layer[0] >= 6 * sum(map(len, prompts))
    assert all(sum(v) == 0 for v in llm.stats()["moe_expert_tokens"].values())     # read clears


@pytest.mark.slow
def test_super_latent_moe_and_mtp_equal_transformers(super_dir):
    prompts = _prompts(2, [140, 20], seed=6)
    ref = hf_greedy(super_dir, prompts, max_new_tokens=6)
    llm = LLM(super_dir, dtype="float32", device=DEV, max_num_seqs=2, max_num_batched_tokens=64,
              speculative_config=SpeculativeConfig("mtp", 2))
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.stats()["drafts_proposed"] > 0


@pytest.fixture(scope="module")
def latent_dir(model_dirs):
    """A few layers with Super's router (512 experts, top-22, scale 5.0) and a latent MoE."""
    return model_dirs("latent", pattern="M*EME", seed=13, n_routed_experts=512, num_experts_per_tok=22,
                      routed_scaling_factor=5.0, moe_latent_size=8, moe_intermediate_size=16,
                      moe_shared_expert_intermediate_size=32)


def test_latent_moe_greedy_equals_transformers(latent_dir):
    prompts = _prompts(3, [21, 5, 40], seed=8)
    ref = hf_greedy(latent_dir, prompts, max_new_tokens=8)
    llm = LLM(latent_dir, dtype="float32", device=DEV, max_num_seqs=2, max_num_batched_tokens=16)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_latent_moe_matches_its_definition(latent_dir):
    """The latent MoE block alone against the formula written out with the merged weights."""
    from hybrid_engine.models.moe_ops import route_ref
    llm = LLM(latent_dir, dtype="float32", device=DEV, max_num_seqs=1)
    moe = llm.engine.model.backbone.layers[2].mixer
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0)).to(moe.gate.weight.device)
    with torch.no_grad():
        ids, w = route_ref(torch.nn.functional.linear(x, moe.gate.weight), moe.gate.e_score_correction_bias,
                           moe.gate.spec)
        lat = x @ moe.fc1_latent_proj.weight.T
        want = torch.zeros(9, lat.shape[1], device=x.device)
        for t in range(9):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                hid = torch.relu(lat[t] @ moe.experts.up_proj[e].T) ** 2
                want[t] += w[t, j] * (hid @ moe.experts.down_proj[e].T)
        sh = moe.shared_experts
        want = want @ moe.fc2_latent_proj.weight.T + torch.relu(x @ sh.up_proj.weight.T) ** 2 @ sh.down_proj.weight.T
        got = moe(x)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_expert_load_counts_each_real_token_once(hybrid_dir):
    """stats()["moe_expert_tokens"]: every token the model processes (prompt tokens, and each
    generated token but the last) is counted top-k times per MoE layer; CUDA-graph padding rows
    (3 requests run in a bucket of 4 on CUDA) are not."""
    llm = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=3)
    prompts = _prompts(3, [5, 9, 17], seed=7)
    llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    load = llm.stats()["moe_expert_tokens"]
    k = llm.engine.cfg.model.num_experts_per_tok
    processed = sum(len(p) + 6 - 1 for p in prompts)
    backbone = {name: sum(c) for name, c in load.items() if name.startswith("backbone.")}
    assert backbone and all(v == k * processed for v in backbone.values()), (backbone, k * processed)
