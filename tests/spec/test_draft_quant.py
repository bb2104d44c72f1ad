"""FP8 drafter weights (``SpeculativeConfig.quantization="fp8"``): the linear layers of the MTP
block and the lm_head rows it scores, or of the whole draft model, gain FP8 copies that few-row
calls read; the target's weights (its lm_head included) are untouched, so greedy outputs stay
transformers'; the drafts are those of the FP8 copies (a naive recompute with an independently
quantized head); bad settings are refused up front."""
import os

import numpy as np
import pytest
import torch
from torch import nn

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hf_reference import hf_greedy

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
# the engine tests compare float32 engines with transformers. The two greedy ones run on the test
# device (on CUDA the FP8 decode kernels then read the float32 engine's rows); the others stay on the
# CPU (a naive recompute through the reference, byte budgets). More CUDA engines:
# tests/gpu/test_spec_step_graphs.py::test_fp8_drafters_propose_the_general_paths_drafts
ENGINE_DEV = "cpu"
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


# prompt ids of 1 to 37 tokens (one longer than a 24-token chunk)
_RNG = np.random.default_rng(13)
PROMPTS = [_RNG.integers(3, 256, n).tolist() for n in (1, 6, 21, 37)]


@pytest.fixture(scope="module")
def prompts():
    return PROMPTS


@pytest.fixture(scope="module")
def reference(hybrid_dir):
    """transformers' greedy tokens for PROMPTS."""
    return hf_greedy(hybrid_dir, PROMPTS, max_new_tokens=GREEDY.max_tokens)


def _llm(model_dir, spec, **kw):
    args = dict(dtype="float32", device=ENGINE_DEV, max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                num_kv_blocks=64, async_scheduling=False)
    args.update(kw)
    return LLM(model_dir, speculative_config=spec, **args)


def _generate(llm, prompts, params=GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    return [o.outputs[0].token_ids for o in outs], st


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_fp8_drafters_keep_transformers_greedy(hybrid_dir, prompts, reference, method):
    from hybrid_engine.models.moe import Experts
    from hybrid_engine.quantization.fp8 import MAX_SKINNY_ROWS
    from hybrid_engine.quantization.linear import Fp8Linear, QuantLinear
    from hybrid_engine.spec.drafters.draft_quant import FewRowsFp8, FewRowsFp8Experts
    draft = str(hybrid_dir) if method == "draft_model" else None        # the target as its own draft
    # eager on CUDA too: the hooks below count module calls, which graph replays do not make
    llm = _llm(hybrid_dir, SpeculativeConfig(method, 3, model=draft, quantization="fp8"),
               async_scheduling=method == "mtp", device=DEV, enforce_eager=True)
    model, drafter = llm.engine.model, llm.engine.drafter
    drafting = model.mtp if method == "mtp" else drafter.model
    copies = {n: m for n, m in drafting.named_modules() if isinstance(m, FewRowsFp8)}
    calls = {"narrow": 0, "wide": 0}
    for m in copies.values():
        for side in ("narrow", "wide"):
            getattr(m, side).register_forward_hook(lambda *a, side=side: calls.__setitem__(side, calls[side] + 1))
    expert_sides = {"narrow": 0, "wide": 0}
    for m in drafting.modules():
        if isinstance(m, FewRowsFp8Experts):
            for side in ("narrow", "wide"):
                part = getattr(m, side)
                part.weights_for = (lambda rows, part=part, side=side:
                                    expert_sides.__setitem__(side, expert_sides[side] + 1)
                                    or type(part).weights_for(part, rows))
    toks, st = _generate(llm, prompts)
    assert toks == reference
    assert st["drafts_proposed"] > 0
    if method == "draft_model":       # the target drafting for itself in FP8: mostly, not surely, accepted
        assert st["drafts_accepted"] > 0.5 * st["drafts_proposed"], st
    # batches of up to 4 requests: the drafter's single-token steps read the FP8 copies, its wider
    # calls (a prompt chunk, the MTP pass over 4 rows of 1 + K tokens) the 16-bit weights
    assert calls["narrow"] > 0 and calls["wide"] > 0, calls
    # the target is untouched: no quantized module outside the drafter, its lm_head included
    outside = [n for n, m in model.named_modules() if isinstance(m, (QuantLinear, FewRowsFp8))
               and not n.startswith("mtp.")]
    assert outside == [] and type(model.lm_head) is not FewRowsFp8
    bare = [n for n, m in drafting.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, QuantLinear)
            and n.rpartition(".")[0] not in copies]
    # every linear layer of the drafter has an FP8 copy, the shared experts' too
    assert bare == [] and len(copies) > 3 and any("shared_experts" in n for n in copies), bare
    assert all(isinstance(m.narrow, Fp8Linear) and m.narrow.weight_scale.shape == (m.out_features,)
               and m.max_rows == MAX_SKINNY_ROWS == 8 for m in copies.values())
    # and every routed-expert set an FP8 copy with a scale an expert, read by the same row rule
    experts = [m for m in drafting.modules() if isinstance(m, FewRowsFp8Experts)]
    assert experts and all(n.endswith(".wide") for n, m in drafting.named_modules() if type(m) is Experts)
    assert all(m.narrow.up_proj.dtype == torch.float8_e4m3fn and m.narrow.up_proj_weight_scale.shape
               == (m.wide.up_proj.shape[0],) and m.max_rows == 8 for m in experts)
    # the MTP block's MoE sees one row per sequence (models/mtp.py's row cut): never more than 4
    # here, so only the draft model's prompt chunks read the 16-bit experts
    assert expert_sides["narrow"] > 0 and (expert_sides["wide"] > 0) == (method == "draft_model"), expert_sides
    head = drafter.draft_logits.head if method == "mtp" else drafter.model.lm_head
    assert isinstance(head, FewRowsFp8) and head.narrow.out_features == model.cfg.vocab_size
    if method == "mtp":               # the greedy drafts (the fused graphs' path) go through it too
        assert drafter.draft_argmax == drafter.draft_logits.argmax


def test_fp8_mtp_drafts_match_naive_recompute(hybrid_dir, prompts):
    """With every call on the FP8 side, the draft distributions of a sampled request after the
    prefill equal a naive recompute through the MTP block and an FP8 head quantized here,
    independently of the drafter's chunked copy; the unquantized head gives measurably other ones."""
    from test_spec_decode import _full_hidden, _naive_mtp
    from hybrid_engine.quantization.linear import Fp8Linear
    from hybrid_engine.spec.drafters import mtp as mtp_mod
    from hybrid_engine.spec.drafters.draft_quant import FewRowsFp8, FewRowsFp8Experts
    llm = _llm(hybrid_dir, SpeculativeConfig("mtp", 2, quantization="fp8"), max_num_seqs=1, max_num_batched_tokens=256)
    model = llm.engine.model
    for m in list(model.mtp.modules()) + [llm.engine.drafter.draft_logits.head]:
        if isinstance(m, (FewRowsFp8, FewRowsFp8Experts)):
            m.max_rows = 10**9
    recorded = []
    orig = mtp_mod.MTPDrafter.propose

    def record(self, ctx):
        drafts, probs = orig(self, ctx)
        recorded.append((drafts.cpu(), probs.cpu(), ctx.num_valid.cpu()))
        return drafts, probs
    mtp_mod.MTPDrafter.propose = record
    try:
        prompt = prompts[3]
        out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=1.0, seed=3, ignore_eos=True),
                           use_tqdm=False)
    finally:
        mtp_mod.MTPDrafter.propose = orig
    drafts, probs, valid = recorded[0]
    assert valid[0] == 1
    fp8_head = Fp8Linear.quantized_from(model.lm_head, per_channel=True)
    seq, p = prompt + out[0].outputs[0].token_ids, len(prompt)

    def q(h, head):
        return torch.softmax(model.compute_logits(model.mtp.layers[-1].final_layernorm(h[-1:]), head), -1)[0].cpu()
    with torch.inference_mode():
        hidden = _full_hidden(llm, seq[:p])
        dev = hidden.device
        emb = model.backbone.embeddings(torch.tensor(seq[1:p + 1], device=dev))
        h = _naive_mtp(model.mtp, emb, hidden)
        emb2 = torch.cat([emb, model.backbone.embeddings(drafts[0, :1].to(dev))])   # draft 1 as drawn
        h2 = _naive_mtp(model.mtp, emb2, torch.cat([hidden, h[-1:]]))
        want = [q(h, fp8_head), q(h2, fp8_head)]
        unquantized = q(h, None)
    for j in range(2):
        torch.testing.assert_close(probs[0, j], want[j], rtol=1e-4, atol=1e-6)
    assert (probs[0, 0] - unquantized).abs().max() > 1e-3, "the FP8 head changes the draft distribution"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fp8_copy_in_chunks_equals_the_whole(monkeypatch, bias, dtype):
    """The drafter's copy (per-channel quantization in chunks of rows, ``fp8.quantize_fp8``) has
    the codes and scales of quantizing the whole layer at once; the bias keeps the layer's dtype."""
    from hybrid_engine.quantization import fp8
    from hybrid_engine.quantization.linear import Fp8Linear, Nvfp4Linear
    from hybrid_engine.spec.drafters import draft_quant
    lin = _random_linear(48, 50, bias, seed=1).to(dtype)
    with torch.no_grad():
        lin.weight[9] = 0.0                                  # an all-zero row: scale 1
    ref = Fp8Linear.quantized_from(lin, per_channel=True)   # 50 rows: one chunk
    monkeypatch.setattr(fp8, "QUANT_CHUNK_ROWS", 7)
    got = draft_quant.FewRowsFp8(lin).narrow
    assert isinstance(got, Fp8Linear) and got.weight_scale.shape == (50,)
    assert torch.equal(got.weight.view(torch.uint8), ref.weight.view(torch.uint8))
    assert torch.equal(got.weight_scale, ref.weight_scale) and got.weight_scale[9] == 1.0
    if bias:
        assert got.bias.dtype == dtype and torch.equal(got.bias, lin.bias)
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(got(x), ref(x), rtol=0, atol=0)
    # a head that is quantized already (FP8 or NVFP4) is used as it is; a module that is not a
    # linear layer is refused
    nvfp4 = Nvfp4Linear.quantized_from(_random_linear(48, 50, bias, seed=5))
    assert draft_quant.draft_head(ref) is ref and draft_quant.draft_head(nvfp4) is nvfp4
    with pytest.raises(TypeError, match="lm_head"):
        draft_quant.draft_head(nn.Embedding(4, 4))


def _random_linear(k, n, bias, seed):
    from hybrid_engine.models.linear import Linear
    g = torch.Generator().manual_seed(seed)
    lin = Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 4)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


@pytest.mark.parametrize("shape", [(1, 32), (8, 32), (9, 32), (2, 4, 32), (3, 3, 32), (0, 32)])
def test_few_rows_take_the_fp8_copy(shape):
    """At most max_rows rows (all leading dims together) go through the FP8 copy, more through the
    16-bit layer, for forward and forward_relu2 alike; weight and bias are the 16-bit ones."""
    from hybrid_engine.models.activation import relu2
    from hybrid_engine.spec.drafters.draft_quant import FewRowsFp8
    lin = _random_linear(32, 24, True, seed=3)
    m = FewRowsFp8(lin, max_rows=8)
    assert m.weight is lin.weight and m.bias is lin.bias and m.max_rows == 8
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    rows = x.numel() // 32
    side = m.narrow if rows <= 8 else lin
    other = lin if side is m.narrow else m.narrow
    seen = []
    side.register_forward_hook(lambda *a: seen.append(1))
    with torch.no_grad():
        assert torch.equal(m(x), side(x)) and torch.equal(m.forward_relu2(x), side(relu2(x)))
        if rows:
            assert not torch.equal(m(x), other(x)), "the two sides differ: the test can tell them apart"
    # the chosen side is called as a module (forward hooks, e.g. calibration, see its input), also
    # through project_relu2
    assert len(seen) == 4 + (1 if rows else 0), seen


@pytest.mark.parametrize("latent", [False, True], ids=["plain", "latent"])
def test_few_rows_moe_reads_the_fp8_experts(latent):
    """A MoE layer with FP8 copies (add_fp8_copies): at most 8 token rows it equals the layer with
    its routed experts quantized per expert (Fp8Experts) and its shared expert (and latent
    projections) per channel (Fp8Linear); at 9 rows it equals the 16-bit layer, bit for bit (CUDA:
    the fused decode kernels, bfloat16)."""
    import copy
    from hybrid_engine.config import MOE, ModelConfig
    from hybrid_engine.models.moe import MoE
    from hybrid_engine.models.synthetic import sens_init_
    from hybrid_engine.quantization.experts import Fp8Experts
    from hybrid_engine.quantization.linear import Fp8Linear
    from hybrid_engine.spec.drafters.draft_quant import FewRowsFp8Experts, add_fp8_copies
    cfg = ModelConfig(layer_types=(MOE,), vocab_size=16, hidden_size=48, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=24, intermediate_size=64, n_routed_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=40, moe_shared_expert_intermediate_size=56,
                      routed_scaling_factor=2.5, moe_latent_size=32 if latent else None)
    wide = MoE(cfg)
    sens_init_(wide, seed=7)                               # O(1)-scale weights
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16          # CUDA: a bfloat16 engine's rows
    wide = wide.to(DEV, dtype)
    wide.gate.weight.data = wide.gate.weight.data.float()              # the router runs in float32
    wide.reset_runtime_state()
    moe, narrow = copy.deepcopy(wide), copy.deepcopy(wide)
    assert add_fp8_copies(moe, "test") == 3 + (2 if latent else 0)    # 2 shared, the experts, latent (router: float32)
    assert isinstance(moe.experts, FewRowsFp8Experts) and moe.experts.max_rows == 8
    narrow.experts = Fp8Experts.quantized_from(wide.experts)
    for owner, name in ([(narrow.shared_experts, "up_proj"), (narrow.shared_experts, "down_proj")]
                        + ([(narrow, "fc1_latent_proj"), (narrow, "fc2_latent_proj")] if latent else [])):
        setattr(owner, name, Fp8Linear.quantized_from(getattr(owner, name), per_channel=True))
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for rows in (1, 8, 9):
            x = torch.randn(rows, 48, generator=g).to(DEV, dtype)
            got, want = moe(x), (narrow if rows <= 8 else wide)(x)
            assert torch.equal(got, want), rows
            if rows <= 8:
                assert not torch.allclose(got, wide(x)), "FP8 changes the output: the test tells the sides apart"


def test_fp8_head_over_a_reduced_draft_vocabulary(hybrid_dir, prompts, reference):
    """With draft_vocab_size the FP8 copy holds only those rows; outputs stay transformers'."""
    from hybrid_engine.quantization.linear import Fp8Linear
    from hybrid_engine.spec.drafters.draft_quant import FewRowsFp8
    llm = _llm(hybrid_dir, SpeculativeConfig("mtp", 3, draft_vocab_size=64, quantization="fp8"), device=DEV)
    toks, st = _generate(llm, prompts)
    assert toks == reference and st["drafts_proposed"] > 0
    head = llm.engine.drafter.draft_logits.head
    assert isinstance(head, FewRowsFp8) and isinstance(head.narrow, Fp8Linear) and head.narrow.weight.shape[0] == 64


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_footprints_are_the_copies_bytes(hybrid_dir, model_dirs, tied):
    """The KV budget leaves room for exactly the copies the drafters build: the MTP block's and
    head's, and a draft model's (with biases; a checkpoint with tied embeddings too)."""
    from hybrid_engine.config import EngineConfig
    from hybrid_engine.spec.drafters import drafter_footprint
    from hybrid_engine.spec.drafters.draft_quant import FewRowsFp8, FewRowsFp8Experts
    draft = model_dirs(f"fp8_draft_{tied}", pattern="M*-E", seed=4, tie_word_embeddings=tied,
                       attention_bias=True, mlp_bias=True)

    def fixed(method, **kw):
        spec = SpeculativeConfig(method, 2, model=str(draft) if method == "draft_model" else None, **kw)
        return drafter_footprint(EngineConfig.resolve(hybrid_dir, device="cpu", speculative_config=spec)).fixed_bytes

    def built(module):        # the copies' tensors, routed experts included (pattern "M*-E", "*E")
        copies = [m for m in module.modules() if isinstance(m, (FewRowsFp8, FewRowsFp8Experts))]
        return sum(t.numel() * t.element_size() for m in copies for t in m.narrow.parameters())
    assert fixed("mtp") == 0
    for rows in (None, 40):
        llm = _llm(hybrid_dir, SpeculativeConfig("mtp", 2, draft_vocab_size=rows, quantization="fp8"))
        d = llm.engine.drafter
        assert d.draft_logits.head.narrow.out_features == (rows or llm.engine.cfg.model.vocab_size)
        assert fixed("mtp", quantization="fp8", draft_vocab_size=rows) == built(d.mtp) + built(d.draft_logits.head) > 0
    llm = _llm(hybrid_dir, SpeculativeConfig("draft_model", 2, model=str(draft), quantization="fp8"))
    model = llm.engine.drafter.model
    assert fixed("draft_model", quantization="fp8") - fixed("draft_model") == built(model) > 0


@pytest.mark.parametrize("kw, words", [
    (dict(method="ngram", num_speculative_tokens=2, quantization="fp8"), "ngram"),
    (dict(method="mtp", num_speculative_tokens=2, quantization="int8"), "quantization must be None or one of 'fp8'"),
    (dict(method="mtp", num_speculative_tokens=2, quantization="FP8"), "quantization must be"),
    (dict(method="mtp", num_speculative_tokens=2, quantization=8), "quantization must be"),
])
def test_bad_quantization(kw, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig(**kw)


def test_quantization_checked_against_the_engine(hybrid_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization='fp8' needs tensor_parallel_size 1"):
        LLM(hybrid_dir, device=DEV, tensor_parallel_size=2, speculative_config=SpeculativeConfig("mtp", 2, quantization="fp8"))
    from hybrid_engine.quantize import quantize_folder
    stored = tmp_path / "fp8_draft"
    quantize_folder(hybrid_dir, stored, "fp8", calibrate_prompts=0)
    with pytest.raises(ValueError, match="is stored in 'fp8'; leave quantization None"):
        _llm(hybrid_dir, SpeculativeConfig("draft_model", 2, model=str(stored), quantization="fp8"))
    # the engine stays usable after the refusals
    toks, _ = _generate(_llm(hybrid_dir, SpeculativeConfig("mtp", 2, quantization="fp8")), [[5, 6, 7]],
                        SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(toks[0]) == 3


def test_cuda_needs_float8_any_dtype(hybrid_dir, monkeypatch):
    from hybrid_engine.config import EngineConfig, ModelConfig
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "A100")

    def cfg(cap, dtype):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cap)
        return EngineConfig(model_dir=hybrid_dir, model=ModelConfig.from_json(hybrid_dir), dtype=dtype,
                            device=torch.device("cuda", 0),
                            speculative=SpeculativeConfig("mtp", 2, quantization="fp8"))
    with pytest.raises(ValueError, match=r"quantization='fp8' needs a GPU with float8 support .* A100 has 8.0"):
        cfg((8, 0), torch.bfloat16)
    # any engine dtype: the FP8 decode kernels read bfloat16, float16 and float32 rows
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert cfg((9, 0), dtype).speculative.quantization == "fp8"


def test_cli_flag(capsys):
    from hybrid_engine.cli import main
    assert main(["generate", "--spec", "mtp", "--draft-quantization", "fp8", "--max-tokens", "6",
                 "--prompt", "def main():", "--no-progress", "--device", "cpu"]) == 0
    assert "mean acceptance length" in capsys.readouterr().out
    rc = main(["generate", "--spec", "ngram", "--draft-quantization", "fp8", "--max-tokens", "2", "--prompt", "x",
               "--device", "cpu"])
    assert rc != 0 and "method='ngram' has none" in capsys.readouterr().err
    rc = main(["generate", "--draft-quantization", "fp8", "--max-tokens", "2", "--prompt", "x", "--device", "cpu"])
    assert rc != 0 and "--draft-quantization is used by --spec mtp or draft_model only" in capsys.readouterr().err
