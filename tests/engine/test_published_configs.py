"""The published Nemotron-H releases (tests/fixtures/published_configs.json), as reduced-size
checkpoints (published_models.py: every key and the exact layer pattern kept, widths shrunk, the
real time_step_min 0.001): they parse, load and decode greedily exactly like transformers (float32,
O(1)-scale weights), with prompts longer than one prefill chunk and one SSD chunk, with async
scheduling and speculative decoding (MTP where the release has it, else n-gram).

dt: the engine uses the Mamba2 kernels' semantics (dt limited to time_step_limit = (0, inf) on every
path); transformers clamps dt to time_step_min on its multi-token path only (docs/checkpoints.md).
The equality tests use ``dt_safe`` weights, on which every dt stays above 0.001, so both of
transformers' paths agree (checked with ``hf_dt_values``); ``test_dt_semantics_*`` use the plain
init, where the clamp fires, and compare with transformers fed one token at a time (never clamps).
Every release is tested; with the exact layer patterns (52 to 98 layers) and the expert counts
kept (128 experts top-6, 512 experts top-22) most take minutes on 2 CPU cores, so the CPU suite
runs 8B greedy, the prefix variants and the dt tests; the rest is marked ``slow``
(``pytest -m slow tests/engine/test_published_configs.py``).
"""
import math

import numpy as np
import pytest

from hf_reference import hf_dt_values, hf_greedy, hf_logits, hf_stepwise_greedy
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.config import ModelConfig
from published_models import MOE_NAMES, MTP_NAMES, NAMES, copy_with_prefix, make_published_model, published

# in the CPU suite: 8B; the others (same code paths, more layers or 128 / 512 experts) take
# minutes on 2 busy CPU cores and are marked slow
ALL = [n if n == "h8b" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES]
ALL_SPEC = [pytest.param(n, marks=pytest.mark.slow) for n in NAMES]
# dt-semantics tests: the 8B config with the real time_step_min, its first 8 blocks only (the
# property is per Mamba layer; the full pattern is covered by the equality tests above)
DT_PATTERN = "M-M-M-M*"
PROMPT_LENS = (40, 5)              # 40 > prefill budget 16 and > 2 SSD chunks (chunk_size 16)
NEW = 6


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("published")
    cache = {}

    def get(name, **kw):
        key = (name, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = make_published_model(root / f"{name}-{len(cache)}", name, seed=5, **kw)
        return cache[key]
    return get


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 512, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def refs(built, prompts):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = hf_greedy(built(name), prompts, NEW)
        return cache[name]
    return get


@pytest.mark.parametrize("name", NAMES)
def test_full_size_config_parses(name):
    entry = published(name)
    cfg = entry["config"]
    mc = ModelConfig.from_dict(cfg)
    assert entry["url"] == "https://huggingface.co/" + entry["repo"]
    assert "".join(mc.layer_types) == cfg["hybrid_override_pattern"]
    assert mc.num_layers == cfg["num_hidden_layers"]
    assert mc.head_dim == cfg.get("head_dim", cfg.get("attention_head_dim"))
    assert mc.time_step_min == 0.001 and mc.time_step_limit == (0.0, math.inf)
    assert mc.torch_dtype == "bfloat16"
    assert mc.n_routed_experts == cfg.get("n_routed_experts", 8)
    assert mc.num_nextn_predict_layers == cfg.get("num_nextn_predict_layers", 0)
    assert mc.moe_latent_size == cfg.get("moe_latent_size")


@pytest.mark.parametrize("name", ALL)
def test_greedy_equals_transformers(built, refs, prompts, name):
    d = built(name)
    for p in prompts:     # the transformers clamp never fires, so its two paths agree
        assert float(hf_dt_values(d, p).min()) > ModelConfig.from_json(d).time_step_min == 0.001
    ref = refs(name)
    llm = LLM(d, dtype="float32", device="cpu", max_num_seqs=2, max_num_batched_tokens=16,
              async_scheduling=False)
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref


@pytest.mark.parametrize("name", ALL_SPEC)
def test_async_and_spec_equal_transformers(built, refs, prompts, name):
    d = built(name)
    ref = refs(name)
    method = "mtp" if name in MTP_NAMES else "ngram"
    llm = LLM(d, dtype="float32", device="cpu", max_num_seqs=3, max_num_batched_tokens=16,
              async_scheduling=True, speculative_config=SpeculativeConfig(method=method, num_speculative_tokens=2))
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.stats()["drafts_proposed"] > 0 or method == "ngram"


@pytest.mark.parametrize("prefix", ["model.", ""])
def test_other_prefixes_load_the_same_model(built, refs, prompts, prefix, tmp_path):
    other = copy_with_prefix(built("h8b"), tmp_path / "renamed", prefix)
    llm = LLM(other, dtype="float32", device="cpu", max_num_seqs=1)
    out = llm.generate(prompts[1:], SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == refs("h8b")[1]


# ---- dt semantics with the real time_step_min, where transformers' clamp fires --------------------

@pytest.fixture(scope="module")
def raw_dir(built):
    d = built("h8b", dt_safe=False, hybrid_override_pattern=DT_PATTERN, num_hidden_layers=len(DT_PATTERN))
    assert ModelConfig.from_json(d).time_step_min == 0.001
    return d


def test_dt_semantics_clamp_really_fires(raw_dir, prompts):
    """On the plain O(1) init a share of dt values is below time_step_min = 0.001, and
    transformers' prefill (clamped) and token-by-token (unclamped) logits disagree."""
    p = prompts[0]
    assert float((hf_dt_values(raw_dir, p) < 1e-3).float().mean()) > 0.01
    _, step_logits = hf_stepwise_greedy(raw_dir, p, 1)
    assert float((step_logits - hf_logits(raw_dir, p)).abs().max()) > 1e-2


@pytest.mark.parametrize("budget", [16, 1])
def test_dt_semantics_equal_kernel_semantics(raw_dir, prompts, budget):
    """Engine prefill-then-decode (prefill chunks of 16 tokens, or of 1 token: all-decode) equals
    transformers' single-token path token for token: dt is never clamped to time_step_min."""
    llm = LLM(raw_dir, dtype="float32", device="cpu", max_num_seqs=1, max_num_batched_tokens=budget)
    for p in prompts[:1] if budget > 1 else [prompts[0][:20]]:
        ref, _ = hf_stepwise_greedy(raw_dir, p, NEW)
        out = llm.generate([p], SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref
