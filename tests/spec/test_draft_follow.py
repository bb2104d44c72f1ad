"""``model.follow`` (a draft model following a step after which it drafts nothing: adaptive
speculation at rest) leaves exactly the caches of the model's full forward (Mamba conv and SSM
states, KV), bit for bit: at steady steps of real engines the draft's caches are snapshotted, the
full forward runs, then from the same caches the follow; the two must be equal and differ from the
snapshot. Draft patterns where the last cache-owning block is an attention block followed by an
MLP (``M*-``: k / v only, the MLP skipped), a Mamba block (``*M-``) and an attention block after
a MoE (``ME*``)."""
import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.spec.drafters.draft_model import DraftModelDrafter


def _caches(d):
    return list(d.pool.conv_state) + list(d.pool.ssm_state) + list(d.kv.k) + list(d.kv.v)


@pytest.mark.parametrize("draft_pattern", ["M*-", "*M-", "ME*"])
def test_follow_leaves_the_full_forwards_caches(model_dirs, hybrid_dir, monkeypatch, draft_pattern):
    name = "draft_follow_" + draft_pattern.replace("*", "a").replace("-", "m")
    draft = model_dirs(name, pattern=draft_pattern, seed=4)
    llm = LLM(hybrid_dir, dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("draft_model", 2, model=str(draft), adaptive=False))
    checked = []
    orig = DraftModelDrafter.propose

    def compare(self, ctx):
        fb = ctx.forward_batch
        if ctx.is_decode.all():
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
            checked.append(fb.mamba.num_decode_rows)
        return orig(self, ctx)
    monkeypatch.setattr(DraftModelDrafter, "propose", compare)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(3, 200, n).tolist() for n in (9, 14, 5)]
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert len(checked) >= 4 and max(checked) == 3, checked
