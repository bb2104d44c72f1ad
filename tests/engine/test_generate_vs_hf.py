"""docs/design.md invariant 1: greedy output equals transformers' generate, token for token (float32, O(1) weights)."""
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from hf_reference import engine_prefill_hidden, hf_greedy, hf_logits

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")   # "cuda" runs the same tests on a GPU


def engine_prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one prefill, through the engine's model and caches."""
    with torch.inference_mode():
        return llm.engine.model.compute_logits(engine_prefill_hidden(llm, ids)).cpu()


@pytest.mark.parametrize("pattern", ["MM", "M*", "M-", "ME", "M-M*-ME*"])
def test_prefill_logits_match_transformers(model_dirs, pattern):
    d = model_dirs(f"p{pattern}", pattern=pattern, seed=3)
    llm = LLM(d, dtype="float32", device=DEV, max_num_seqs=2)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 256, 41).tolist()          # > 2 SSD chunks (16) and > 2 KV blocks
    ours = engine_prefill_logits(llm, ids)
    ref = hf_logits(d, ids)
    assert ref.abs().max() > 1.0                      # O(1)-scale model: a state bug would show
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


PROMPT_LENS = [1, 2, 5, 15, 16, 17, 33, 40, 7, 24]    # 1 .. > 2x chunk (16) and > block size


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(42)
    return [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(hybrid_dir, prompts):
    return hf_greedy(hybrid_dir, prompts, max_new_tokens=12)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_transformers_under_pressure(hybrid_dir, prompts, reference, async_scheduling):
    # chunked prefill (budget 24 < prompt 40), queueing and slot reuse (4 seqs < 10 prompts),
    # preemption (12 blocks of 4 tokens for up to 4 running requests of up to 52 tokens)
    llm = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=24,
              block_size=4, num_kv_blocks=20, async_scheduling=async_scheduling)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    for o, ref in zip(outs, reference):
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].finish_reason == "length"
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]


def test_pressure_really_happens(hybrid_dir, prompts, monkeypatch):
    """The configuration above does chunk, queue, reuse slots and preempt."""
    from hybrid_engine.scheduling import scheduler as sched_mod
    seen = {"preempt": 0, "chunks": 0, "slots": set()}
    orig_preempt, orig_row = sched_mod.Scheduler._preempt, sched_mod.Scheduler._row

    def preempt(self, req):
        seen["preempt"] += 1
        return orig_preempt(self, req)

    def row(self, req, n):
        r = orig_row(self, req, n)
        if not r.is_decode and not r.samples:
            seen["chunks"] += 1
        seen["slots"].add((req.request_id, req.slot))
        return r
    monkeypatch.setattr(sched_mod.Scheduler, "_preempt", preempt)
    monkeypatch.setattr(sched_mod.Scheduler, "_row", row)
    llm = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=4, max_num_batched_tokens=24,
              block_size=4, num_kv_blocks=20)
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert seen["preempt"] > 0 and seen["chunks"] > 0
    slots_used = [s for _, s in seen["slots"]]
    assert len(set(slots_used)) <= 4 < len({r for r, _ in seen["slots"]})   # slots were reused


def test_seeded_sampling_is_batch_invariant(hybrid_dir, prompts):
    llm = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=8)
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[3]], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=10, temperature=1.0, seed=i, ignore_eos=True) for i in range(7)]
    batch = llm.generate(prompts[:3] + [prompts[3]] + prompts[4:8], others[:3] + [sp] + others[3:],
                         use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    again = llm.generate([prompts[3]], SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, top_k=50,
                                                      seed=99, ignore_eos=True), use_tqdm=False)
    assert again[0].outputs[0].token_ids != alone   # the seed matters
