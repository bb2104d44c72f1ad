"""Shared checks of the other Mamba2 hybrid families (test_bamba.py, test_granitemoehybrid.py,
test_falcon_h1.py): the engine against transformers float32 on a tiny O(1)-scale checkpoint of the
family (``synthetic.make_family_model``: transformers' own model class and save_pretrained)."""
from __future__ import annotations

import os

import numpy as np
import torch

from hf_reference import engine_prefill_hidden, hf_greedy, hf_logits
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
PROMPT_LENS = (40, 6)             # 40 > the prefill budget (16) and > 2 SSD chunks (chunk 16)
NEW = 6
BUDGET = 16


def prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, n).tolist() for n in PROMPT_LENS]


def reference(model_dir, ps) -> list[list[int]]:
    return hf_greedy(model_dir, ps, max_new_tokens=NEW)


def engine_tokens(model_dir, ps, **kw) -> list[list[int]]:
    llm = LLM(model_dir, dtype="float32", device=DEV, max_num_seqs=3, max_num_batched_tokens=BUDGET,
              block_size=8, **kw)
    outs = llm.generate(ps, SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    st = llm.stats()
    assert st["free_slots"] == st["total_slots"] and st["free_blocks"] == st["total_blocks"]
    return [o.outputs[0].token_ids for o in outs]


def check_prefill_logits(model_dir, n: int = 41) -> None:
    """Logits at every position of one 41-token prefill equal transformers' (no cache)."""
    llm = LLM(model_dir, dtype="float32", device=DEV, max_num_seqs=2)
    ids = np.random.default_rng(1).integers(3, 256, n).tolist()
    with torch.inference_mode():
        ours = llm.engine.model.compute_logits(engine_prefill_hidden(llm, ids)).cpu()
    ref = hf_logits(model_dir, ids)
    assert ref.abs().max() > 1.0                     # O(1)-scale model: a state bug would show
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def spec(method: str, draft_dir=None) -> SpeculativeConfig:
    if method == "ngram":
        return SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    return SpeculativeConfig(method="draft_model", model=str(draft_dir), num_speculative_tokens=2)
