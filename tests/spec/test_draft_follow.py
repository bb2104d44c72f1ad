"""``model.follow`` (a draft model following a step after which it drafts nothing: adaptive
speculation at rest) leaves exactly the caches of the model's full forward (Mamba conv and SSM
states, KV), bit for bit: at steady steps of real engines the draft's caches are snapshotted, the
full forward runs, then from the same caches the follow; the two must be equal and differ from the
snapshot. Every step is checked: prefill chunks (with prefix caching's checkpoint saves, and
restores on a second pass over shared prefixes), mixed and decode steps. Draft patterns where the
last cache-owning block is an attention block followed by an MLP (``M*-``: k / v only, the MLP
skipped), a Mamba block (``*M-``) and an attention block after a MoE (``ME*``)."""
import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.spec.drafters.draft_model import DraftModelDrafter


def _caches(d):
    ckpt = d.caches.checkpoints
    return (list(d.pool.conv_state) + list(d.pool.ssm_state) + list(d.kv.k) + list(d.kv.v)
            + ([] if ckpt is None else [ckpt.conv_all, ckpt.ssm_all]))


@pytest.mark.parametrize("draft_pattern", ["M*-", "*M-", "ME*"])
def test_follow_leaves_the_full_forwards_caches(model_dirs, hybrid_dir, monkeypatch, draft_pattern):
    name = "draft_follow_" + draft_pattern.replace("*", "a").replace("-", "m")
    draft = model_dirs(name, pattern=draft_pattern, seed=4)
    llm = LLM(hybrid_dir, dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("draft_model", 2, model=str(draft), adaptive=False))
    checked = []
    orig = DraftModelDrafter.propose

    def compare(self, ctx):                              # every step: prefill, mixed and decode
        fb = ctx.forward_batch
        caches = _caches(self)
        before = [t.clone() for t in caches]
        self.model(fb, self.caches)                      # the full forward
        full = [t.clone() for t in caches]
        for t, saved in zip(caches, before):
            t.copy_(saved)
        assert self.model.follow(fb, self.caches) is None
        for t, want in zip(caches, full):
            assert torch.equal(t, want)
        assert any(not torch.equal(t, was) for t, was in zip(full, before))
        for t, saved in zip(caches, before):             # the step goes on from where it was
            t.copy_(saved)
        md = fb.mamba
        restores = 0 if md.restore_slots is None else len(md.restore_slots)
        checked.append((md.num_decode_rows, md.num_prefill_rows, restores))
        return orig(self, ctx)
    monkeypatch.setattr(DraftModelDrafter, "propose", compare)
    assert llm.engine.drafter.caches.checkpoints is not None          # prefix caching on: the draft saves too
    rng = np.random.default_rng(6)
    shared = rng.integers(3, 200, 40).tolist()                         # whole blocks shared by the prompts
    prompts = [shared + rng.integers(3, 200, n).tolist() for n in (9, 14, 5)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)                      # hits: restores from checkpoints
    assert any(d == 3 and not p for d, p, _ in checked), checked       # decode steps of the full batch
    assert any(p for _, p, _ in checked) and any(r for _, _, r in checked), checked   # prefill, restores
