"""Speculative decoding is lossless: spec == no spec == transformers greedy, for every drafter."""
import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hf_reference import hf_greedy

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
GREEDY = SamplingParams(max_tokens=14, ignore_eos=True)
PROMPT_LENS = [1, 3, 17, 40, 9, 33]


@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("spec_target", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def random_draft(model_dirs):
    return model_dirs("spec_random_draft", pattern="M*", seed=7)


@pytest.fixture(scope="module")
def noisy_draft(target, tmp_path_factory):
    """The target with perturbed weights: agrees with it often but not always (mixed acceptance)."""
    d = tmp_path_factory.mktemp("noisy")
    for f in target.iterdir():
        if f.suffix != ".safetensors":
            (d / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(0)
    for f in target.glob("*.safetensors"):
        t = load_file(str(f))
        out = {k: (v + 0.5 * v.std() * torch.randn(v.shape, generator=g) if k == "lm_head.weight" else v)
               for k, v in t.items()}
        save_file(out, str(d / f.name), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(target, prompts):
    return hf_greedy(target, prompts, max_new_tokens=GREEDY.max_tokens)


def run(model, prompts, spec=None, params=GREEDY, **kw):
    args = dict(dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                num_kv_blocks=64)
    args.update(kw)
    llm = LLM(model, speculative_config=spec, **args)
    outs = llm.generate(prompts, params, use_tqdm=False)
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    return [o.outputs[0].token_ids for o in outs], st


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("draft", ["self", "random", "noisy"])
def test_draft_model_equals_transformers(target, random_draft, noisy_draft, prompts, reference, draft, k):
    model = {"self": target, "random": random_draft, "noisy": noisy_draft}[draft]
    toks, st = run(target, prompts, SpeculativeConfig("draft_model", k, model=str(model)),
                   async_scheduling=(k % 2 == 0))
    assert toks == reference
    assert st["drafts_proposed"] > 0
    if draft == "self":                       # forced acceptance: every draft accepted
        assert st["drafts_accepted"] == st["drafts_proposed"]
        assert st["mean_acceptance_length"] == pytest.approx(1 + k)
    elif draft == "random":                   # forced rejection (almost always)
        assert st["drafts_accepted"] <= 0.1 * st["drafts_proposed"]
    else:                                     # mixed
        assert 0 < st["drafts_accepted"] < st["drafts_proposed"]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_equals_transformers(target, prompts, reference, k):
    toks, st = run(target, prompts, SpeculativeConfig("mtp", k), async_scheduling=bool(k % 2))
    assert toks == reference
    assert st["drafts_proposed"] > 0


@pytest.mark.parametrize("mtp_pattern", ["*E", "E", "E*", "*-E"])
def test_mtp_drafts_match_naive_recompute(target, model_dirs, prompts, mtp_pattern):
    """The MTP pass with its KV cache equals a naive full recompute of the MTP layers. The engine
    runs the layers after the last attention layer at each row's newest token only (none: all of
    them; attention last: only the final norm); the naive recompute runs every layer on every
    token."""
    if mtp_pattern != "*E":
        target = model_dirs(f"spec_target_mtp_{mtp_pattern.replace('*', 'a').replace('-', 'm')}",
                            pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1, mtp_pattern=mtp_pattern)
    from hybrid_engine.spec.drafters import mtp as mtp_mod
    recorded = []
    orig = mtp_mod.MTPDrafter.propose

    def record(self, ctx):
        drafts, probs = orig(self, ctx)
        recorded.append((ctx.req_ids, drafts.cpu(), ctx.num_valid.cpu()))
        return drafts, probs
    mtp_mod.MTPDrafter.propose = record
    try:
        llm = LLM(target, dtype="float32", device=DEV, max_num_seqs=1, block_size=4, num_kv_blocks=64,
                  speculative_config=SpeculativeConfig("mtp", 2), async_scheduling=False)
        prompt = prompts[3]
        out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    finally:
        mtp_mod.MTPDrafter.propose = orig
    seq = prompt + out[0].outputs[0].token_ids
    # naive: target hidden states of the whole sequence, then the MTP layers as plain causal attention
    _, drafts, valid = recorded[0]            # proposal after the prefill step
    assert valid[0] == 1
    # every later proposal too: after a verify step the kept row is the accepted prefix's end
    length, checked = len(prompt), 0
    for _, drafts, valid in recorded:
        length += int(valid[0])               # committed tokens; the newest sample is seq[length - 1]
        if length > len(seq) or drafts.shape[1] == 0:
            continue
        ref = _naive_mtp_drafts(llm, seq, length - 1)
        width = min(drafts.shape[1], 2)
        assert drafts[0, :width].tolist() == list(ref[:width]), (length, drafts, ref)
        checked += 1
    assert checked >= 3 and len(recorded) >= 3


def _naive_mtp_drafts(llm, seq, prompt_len):
    """Drafts 1 and 2 proposed right after prefilling seq[:prompt_len] and sampling seq[prompt_len]."""
    model = llm.engine.model
    mtp = model.mtp
    p = prompt_len
    with torch.inference_mode():
        hidden = _full_hidden(llm, seq[:p])                       # [p, D] target hidden h_0..h_{p-1}
        dev = hidden.device
        emb = model.backbone.embeddings(torch.tensor(seq[1:p + 1], device=dev))   # t_1..t_p
        h = _naive_mtp(mtp, emb, hidden)                          # pairs 0..p-1
        first = model.compute_logits(mtp.layers[-1].final_layernorm(h[-1:])).argmax(-1).item()
        emb2 = torch.cat([emb, model.backbone.embeddings(torch.tensor([first], device=dev))])
        h2 = _naive_mtp(mtp, emb2, torch.cat([hidden, h[-1:]]))   # pair p uses the MTP hidden
        second = model.compute_logits(mtp.layers[-1].final_layernorm(h2[-1:])).argmax(-1).item()
    return first, second


def _full_hidden(llm, ids):
    from hf_reference import engine_prefill_hidden
    return engine_prefill_hidden(llm, ids)


def _naive_mtp(mtp, emb, prev_hidden):
    first = mtp.layers[0]
    h = first.eh_proj(torch.cat([first.enorm(emb), first.hnorm(prev_hidden)], -1))
    t = h.shape[0]
    for layer in mtp.layers:
        x = layer.norm(h)
        if layer.attn:
            a = layer.mixer
            q = a.q_proj(x).view(t, a.nh, a.hd).transpose(0, 1)
            kk = a.k_proj(x).view(t, a.nkv, a.hd).transpose(0, 1).repeat_interleave(a.nh // a.nkv, 0)
            v = a.v_proj(x).view(t, a.nkv, a.hd).transpose(0, 1).repeat_interleave(a.nh // a.nkv, 0)
            o = torch.nn.functional.scaled_dot_product_attention(q, kk, v, is_causal=True)
            h = h + a.o_proj(o.transpose(0, 1).reshape(t, -1))
        else:
            h = h + layer.mixer(x)
    return h


def test_spec_reused_slot_never_sees_old_drafts(target, prompts, reference):
    """max_num_seqs=1: every request reuses the same slot and row after one that had drafts
    (vLLM PR 39833 bug class), including requests resumed after preemption."""
    toks, st = run(target, prompts, SpeculativeConfig("draft_model", 3, model=str(target)), max_num_seqs=1)
    assert toks == reference
    toks, _ = run(target, prompts, SpeculativeConfig("mtp", 2), max_num_seqs=2, num_kv_blocks=22)
    assert toks == reference


def test_accepted_counts_on_device_never_zero(target, prompts, monkeypatch):
    from hybrid_engine.step import runner as runner_mod
    seen = []
    orig = runner_mod.ModelRunner.execute

    def execute(self, sched):
        handle = orig(self, sched)
        nv = self.prev.num_valid
        assert nv.device.type == torch.device(DEV).type        # computed where the outputs live
        samples = torch.tensor([r.samples for r in [r for r in sched.rows if r.is_decode] +
                                [r for r in sched.rows if not r.is_decode]])
        seen.append((nv.cpu(), samples, (self.prev.sampled != -1).sum(1).cpu()))
        return handle
    monkeypatch.setattr(runner_mod.ModelRunner, "execute", execute)
    run(target, prompts, SpeculativeConfig("draft_model", 3, model=str(target)))
    assert seen
    for nv, samples, ref in seen:
        assert torch.equal(nv, ref)
        assert (nv[samples] >= 1).all() and (nv[~samples] == 0).all()


def test_seeded_sampling_self_draft_equals_no_spec(target, prompts):
    """A draft that samples with the target's own keys (q = p): spec output == no-spec output."""
    sp = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
          for i in range(len(prompts))]
    plain, _ = run(target, prompts, None, sp)
    spec, st = run(target, prompts, SpeculativeConfig("draft_model", 3, model=str(target)), sp)
    assert spec == plain
    assert st["drafts_accepted"] > 0


@pytest.mark.parametrize("kw, words", [
    (dict(method="eagle", num_speculative_tokens=2), "method"),
    (dict(method="ngram", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(method="ngram", num_speculative_tokens=9), "num_speculative_tokens"),
    (dict(method="draft_model", num_speculative_tokens=2), "model"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2), "prompt_lookup"),
    (dict(method="ngram", num_speculative_tokens=2, prompt_lookup_min=0), "prompt_lookup_min"),
])
def test_bad_speculative_config(kw, words):
    with pytest.raises(ValueError, match=words):
        SpeculativeConfig(**kw)


def test_draft_with_other_vocab_and_mtp_without_weights(target, model_dirs):
    other = model_dirs("other_vocab", pattern="M*", vocab_size=300, seed=3)
    with pytest.raises(ValueError, match="vocab"):
        LLM(target, speculative_config=SpeculativeConfig("draft_model", 2, model=str(other)))
    plain = model_dirs("spec_plain", pattern="M*", seed=4)
    with pytest.raises(ValueError, match="mtp|MTP"):
        LLM(plain, speculative_config=SpeculativeConfig("mtp", 2))


def _budget_is_kv_cache_bytes(monkeypatch):
    """The budget is ``kv_cache_bytes`` on every device (on CUDA an engine takes a fraction of the
    free memory instead): these tests are about what the drafter's share takes from it."""
    from hybrid_engine import device_side
    monkeypatch.setattr(device_side, "_kv_budget", lambda cfg: cfg.cache.kv_cache_bytes)


def test_kv_budget_leaves_room_for_the_draft_model(target, random_draft, monkeypatch):
    """The KV budget covers target + draft together (the draft model's weights, Mamba pool and its
    own KV per block id), so a draft model never runs out of memory after the target sized its cache."""
    _budget_is_kv_cache_bytes(monkeypatch)
    budget = 3 * 2**20
    common = dict(dtype="float32", device=DEV, max_num_seqs=4, block_size=4, kv_cache_bytes=budget)
    alone = LLM(target, **common).engine
    spec = LLM(target, speculative_config=SpeculativeConfig("draft_model", 3, model=str(random_draft)), **common).engine
    drafter = spec.drafter
    draft_weights = sum(p.numel() * p.element_size() for p in drafter.model.parameters())
    draft_weights += sum(b.numel() * b.element_size() for b in drafter.model.buffers())
    taken = spec.caches.kv.bytes + drafter.kv.bytes + drafter.pool.bytes + draft_weights
    assert taken <= budget, (taken, budget)
    # and it is not over-cautious: one more block would not have fitted
    per_block = spec.caches.kv.bytes // spec.caches.kv.num_blocks + drafter.kv.bytes // drafter.kv.num_blocks
    assert taken + per_block > 0.95 * budget
    assert spec.caches.kv.num_blocks < alone.caches.kv.num_blocks
    assert drafter.kv.num_blocks == spec.caches.kv.num_blocks


def test_kv_budget_covers_the_mtp_blocks_own_kv(target, monkeypatch):
    """An MTP block with attention keeps its own KV per block id: target + MTP KV fit the budget."""
    _budget_is_kv_cache_bytes(monkeypatch)
    budget = 3 * 2**20
    llm = LLM(target, dtype="float32", device=DEV, max_num_seqs=4, block_size=4, kv_cache_bytes=budget,
              speculative_config=SpeculativeConfig("mtp", 2))
    eng = llm.engine
    taken = eng.caches.kv.bytes + eng.drafter.kv.bytes
    assert eng.drafter.kv.num_layers >= 1
    assert budget * 0.95 < taken <= budget, (taken, budget)
