"""A reduced MTP draft vocabulary (``SpeculativeConfig.draft_vocab_size``): drafts come from the
first rows of the lm_head only, the outputs stay those of the full vocabulary (transformers greedy),
the sampled draft probabilities put no mass beyond the rows, and bad values are refused up front."""
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hf_reference import hf_greedy

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(hybrid_dir):
    return hybrid_dir


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(3, 256, n).tolist() for n in (1, 5, 23, 40)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return hf_greedy(target, prompts, max_new_tokens=GREEDY.max_tokens)


def _run_recording(target, prompts, params, **spec_kw):
    """Generate with MTP (K = 3); returns (token ids, stats, every proposal's (drafts, probs))."""
    from hybrid_engine.spec.drafters import mtp as mtp_mod
    seen = []
    orig = mtp_mod.MTPDrafter.propose

    def record(self, ctx):
        drafts, probs = orig(self, ctx)
        seen.append((drafts.cpu(), None if probs is None else probs.cpu()))
        return drafts, probs
    mtp_mod.MTPDrafter.propose = record
    try:
        llm = LLM(target, dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                  num_kv_blocks=64, speculative_config=SpeculativeConfig("mtp", 3, adaptive=False, **spec_kw),
                  async_scheduling=False)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        mtp_mod.MTPDrafter.propose = orig
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    return [o.outputs[0].token_ids for o in outs], st, seen


def test_greedy_outputs_and_drafts(target, prompts, reference):
    full_toks, full_st, full_seen = _run_recording(target, prompts, GREEDY)
    vocab = LLM(target, dtype="float32", device=DEV, num_kv_blocks=16).engine.cfg.model.vocab_size
    # the whole vocabulary through the view: the same drafts as the plain head
    same_toks, _, same_seen = _run_recording(target, prompts, GREEDY, draft_vocab_size=vocab)
    assert full_toks == reference and same_toks == reference
    assert len(same_seen) == len(full_seen)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(same_seen, full_seen))
    # a quarter of it: other drafts, all below the limit, the same outputs
    rows = vocab // 4
    toks, st, seen = _run_recording(target, prompts, GREEDY, draft_vocab_size=rows)
    assert toks == reference
    drafts = torch.cat([d.reshape(-1) for d, _ in seen])
    assert (drafts[drafts >= 0] < rows).all()
    assert (drafts >= 0).any()
    full_drafts = torch.cat([d.reshape(-1) for d, _ in full_seen])
    assert (full_drafts >= rows).any(), "the full head drafts ids beyond the limit: the test has teeth"
    assert st["drafts_proposed"] > 0
    assert len(set(drafts[drafts >= 0].tolist())) > 1      # (which rows: test_draft_logits_are_the_heads_first_rows)


def test_draft_logits_are_the_heads_first_rows(target):
    """The reduced head's logits equal the full compute_logits on the first rows (same weights,
    same scaling) and are -inf beyond: a head taking other rows, or none, fails here."""
    from hybrid_engine.spec.drafters.draft_vocab import DraftVocabHead
    model = LLM(target, dtype="float32", device=DEV, num_kv_blocks=16).engine.model
    g = torch.Generator().manual_seed(3)
    h = torch.randn(5, model.cfg.hidden_size, generator=g).to(DEV)
    rows = 37
    with torch.inference_mode():
        full = model.compute_logits(h)
        part = DraftVocabHead(model, rows)(h)
    assert part.shape == full.shape and part.dtype == torch.float32
    torch.testing.assert_close(part[:, :rows], full[:, :rows], rtol=1e-6, atol=1e-6)
    assert torch.isneginf(part[:, rows:]).all()
    assert torch.equal(part[:, :rows].argmax(-1), full[:, :rows].argmax(-1))
    with torch.inference_mode():                  # the greedy path's argmax without the padding
        assert torch.equal(DraftVocabHead(model, rows).argmax(h), part.argmax(-1))


def test_sampled_draft_probabilities_stay_inside(target, prompts):
    rows = 40
    params = [SamplingParams(max_tokens=8, temperature=0.9, seed=5 + i, ignore_eos=True) for i in range(len(prompts))]
    toks, st, seen = _run_recording(target, prompts, params, draft_vocab_size=rows)
    assert all(len(t) == 8 for t in toks)
    assert any(p is not None for _, p in seen)
    for drafts, p in seen:
        if p is None:
            continue
        assert torch.all(p[..., rows:] == 0)
        live = drafts >= 0
        assert torch.allclose(p[live].sum(-1), torch.ones(int(live.sum())), atol=1e-5)
        assert (drafts[live] < rows).all()


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("method", ["linear", "fp8_channel", "fp8_tensor", "fp8_channel_n1", "nvfp4"])
def test_head_rows_views_the_first_rows(method, bias):
    from hybrid_engine.models.linear import Linear
    from hybrid_engine.quantization.linear import Fp8Linear, Nvfp4Linear
    from hybrid_engine.spec.drafters.draft_vocab import head_rows
    g = torch.Generator().manual_seed(0)
    lin = Linear(64, 96, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 64, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(96, generator=g))
    if method == "linear":
        head = lin
    elif method == "nvfp4":
        head = Nvfp4Linear.quantized_from(lin)
    else:
        head = Fp8Linear.quantized_from(lin, per_channel=method != "fp8_tensor")
        if method == "fp8_channel_n1":                  # a stored [N, 1] scale
            head.weight_scale = torch.nn.Parameter(head.weight_scale.data.reshape(96, 1), requires_grad=False)
    sub = head_rows(head, 37)
    if method == "fp8_tensor":                          # the per-tensor scale is shared, not sliced
        assert sub.weight_scale.dim() == 0 and sub.weight_scale.data_ptr() == head.weight_scale.data_ptr()
    x = torch.randn(3, 64, generator=g)
    assert sub.out_features == 37 and head.out_features == 96
    torch.testing.assert_close(sub(x), head(x)[:, :37], rtol=1e-6, atol=1e-5)
    assert sub.weight.data_ptr() == head.weight.data_ptr()            # a view, no copy


@pytest.mark.parametrize("kw, words", [
    (dict(method="ngram", num_speculative_tokens=2, draft_vocab_size=16), "mtp"),
    (dict(method="mtp", num_speculative_tokens=2, draft_vocab_size=0), "draft_vocab_size"),
    (dict(method="mtp", num_speculative_tokens=2, draft_vocab_size=2.5), "draft_vocab_size"),
])
def test_bad_draft_vocab_size(kw, words):
    with pytest.raises((ValueError, TypeError), match=words):
        SpeculativeConfig(**kw)


def test_draft_vocab_size_checked_against_the_model(target):
    with pytest.raises(ValueError, match="draft_vocab_size.*vocab_size"):
        LLM(target, device=DEV, speculative_config=SpeculativeConfig("mtp", 2, draft_vocab_size=10**6))
    with pytest.raises(ValueError, match="draft_vocab_size.*tensor_parallel_size"):
        LLM(target, device=DEV, tensor_parallel_size=2, speculative_config=SpeculativeConfig("mtp", 2, draft_vocab_size=8))


def test_cli_flag(capsys, monkeypatch):
    """``--draft-vocab-size`` reaches the MTP drafter with ``--spec mtp`` and is refused without it."""
    from hybrid_engine.cli import main
    from hybrid_engine.spec.drafters import mtp as mtp_mod
    built = []

    class Recording(mtp_mod.DraftVocabHead):
        def __init__(self, target, rows, **kw):
            built.append(rows)
            super().__init__(target, rows, **kw)
    monkeypatch.setattr(mtp_mod, "DraftVocabHead", Recording)
    assert main(["generate", "--spec", "mtp", "--draft-vocab-size", "1024", "--max-tokens", "6",
                 "--prompt", "def main():", "--no-progress", "--device", "cpu"]) == 0
    assert "mean acceptance length" in capsys.readouterr().out
    assert built == [1024]
    rc = main(["generate", "--draft-vocab-size", "1024", "--max-tokens", "2", "--prompt", "x", "--device", "cpu"])
    assert rc != 0
    assert "--draft-vocab-size is used by --spec mtp only, got no --spec" in capsys.readouterr().err
