"""Programmatic dependent launch (``mamba_cache/ops/triton_pdl.py``) on CUDA: with it on, the
engine's greedy tokens equal those with it off, in CUDA graphs and eagerly, at batch 1 (one-row
FMA projections, the MoE pair GEMVs, split-key attention) and batch 8. A kernel launched with PDL
that reads before its wait returns the previous layer's stale output: that broke every batch-1
step of the 8B shape (non-finite logits) while one kernel lacked the wait."""
import pytest
import torch

import kernel_cases as kc

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.mamba_cache.ops.triton_pdl import HAS_GDC, pdl_kwargs, reset_pdl_choice

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def wide_target(model_dirs):
    """Wider than ``target`` so that each kernel runs long enough for an early read to land."""
    return model_dirs("pdl_wide", pattern="M-M*-ME*", seed=2, hidden_size=512, intermediate_size=1024,
                      mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64, n_routed_experts=16,
                      num_experts_per_tok=4, moe_intermediate_size=512, moe_shared_expert_intermediate_size=512,
                      vocab_size=4096)


def _generate(model, prompts, eager: bool, pdl: str, monkeypatch) -> list:
    monkeypatch.setenv("HYBRID_ENGINE_PDL", pdl)
    reset_pdl_choice()
    try:
        llm = LLM(model, dtype="bfloat16", device="cuda", max_num_seqs=8, enforce_eager=eager)
        assert pdl_kwargs(torch.device("cuda"))["PDL"] == (pdl == "1")
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        return [[o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
                for batch in ([prompts[3]], [prompts[5]], prompts)]
    finally:
        monkeypatch.delenv("HYBRID_ENGINE_PDL")
        reset_pdl_choice()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs compute capability 9.0 (Hopper)")
@pytest.mark.parametrize("model", ["target", "wide_target"])
@pytest.mark.parametrize("eager", [False, True])
def test_pdl_equals_no_pdl(request, prompts, monkeypatch, model, eager):
    model_dir = request.getfixturevalue(model)
    off = _generate(model_dir, prompts, eager, "0", monkeypatch)
    on = _generate(model_dir, prompts, eager, "1", monkeypatch)
    assert on == off


def _with_prefetch(env: str, monkeypatch, fn):
    monkeypatch.setenv("HYBRID_ENGINE_PREFETCH", env)
    reset_pdl_choice()
    try:
        assert pdl_kwargs(torch.device("cuda"), prefetch=True).get("PREFETCH", False) == (env == "1")
        out = fn()
        torch.cuda.synchronize()
        return out
    finally:
        monkeypatch.delenv("HYBRID_ENGINE_PREFETCH")
        reset_pdl_choice()


def _prefetch_cases():
    """(name, launch, reference) of every kernel that loads its first weight tile before the
    wait, on ragged shapes (N, K not multiples of the tiles: the early tile is masked)."""
    from hybrid_engine.quantization.fp8 import fp8_linear_ref, quantize_fp8
    from hybrid_engine.quantization.fp8_kernels import fp8_skinny_linear
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for N, K, per_channel in [(1001, 1040, True), (1001, 1040, False), (4096, 4096, True), (37, 160, True),
                              (2048, 8208, True)]:     # 8208: four full K tiles of 2048 and a ragged fifth
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16()
        x1 = torch.randn(1, K, device="cuda", generator=g).bfloat16()
        w_q, scale = quantize_fp8(w, per_channel=per_channel)
        cases.append((f"fp8 one row N={N} K={K} per_channel={per_channel}",
                      lambda x1=x1, w_q=w_q, scale=scale: fp8_skinny_linear(x1, w_q, scale),
                      lambda x1=x1, w_q=w_q, scale=scale: fp8_linear_ref(x1, w_q, scale)))
    return cases


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9
                    or not HAS_GDC, reason="PDL needs compute capability 9.0 (Hopper) and Triton >= 3.5")
def test_weight_prefetch_changes_no_result(monkeypatch):
    """The first weight tile loaded before the wait (``triton_pdl.first_weight_tile``) only moves
    bytes earlier: each such kernel gives bitwise the same output with it on and off, and that
    output matches its float32 reference. The memory the outputs land in is poisoned first."""
    for name, launch, ref in _prefetch_cases():
        want = ref()
        results = {}
        for env in ("0", "1"):
            kc.poison_allocator("cuda")             # the output's torch.empty gets NaN-filled memory
            results[env] = _with_prefetch(env, monkeypatch, launch)
        assert torch.equal(results["0"], results["1"]), name
        got = results["1"].float()
        assert torch.isfinite(got).all(), name
        torch.testing.assert_close(got, want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item(), msg=name)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9
                    or not HAS_GDC, reason="PDL needs compute capability 9.0 (Hopper) and Triton >= 3.5")
def test_fp8_engine_tokens_equal_with_and_without_the_early_weight_tile(wide_target, prompts, monkeypatch):
    """In an engine step the FP8 one-row projection follows kernels that write its input x: with the
    early weight tile (PREFETCH) its greedy tokens equal those without it, at batch 1 and 8."""
    outs = {}
    for env in ("0", "1"):
        monkeypatch.setenv("HYBRID_ENGINE_PREFETCH", env)
        reset_pdl_choice()
        try:
            llm = LLM(wide_target, dtype="bfloat16", device="cuda", max_num_seqs=8, quantization="fp8")
            params = SamplingParams(max_tokens=24, ignore_eos=True)
            outs[env] = [[o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
                         for batch in ([prompts[3]], prompts)]
            del llm
        finally:
            monkeypatch.delenv("HYBRID_ENGINE_PREFETCH")
            reset_pdl_choice()
    assert outs["1"] == outs["0"]
