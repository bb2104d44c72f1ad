"""``MTP.follow`` (the drafter following a step it drafts nothing after: adaptive speculation at
rest) writes exactly the MTP KV of the full pass (``MTP.forward``, what a drafting step writes),
bit for bit, and nothing else: at every step of a real engine (prefill, mixed and decode; arrivals
while others decode) the drafter's KV is snapshotted,
the full first pass runs, then from the same KV the follow; the two caches must be equal and must
differ from the snapshot. MTP blocks: the published ``*E`` and one whose last attention layer
comes after an MLP and another attention layer (``*-*E``: the layers before it run in full)."""
import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.spec.drafters.mtp import MTPDrafter


@pytest.mark.parametrize("mtp_pattern", ["*E", "*-*E"])
def test_follow_writes_the_full_passes_kv_and_nothing_else(model_dirs, monkeypatch, mtp_pattern):
    target = model_dirs(f"mtp_follow_{mtp_pattern.replace('*', 'a').replace('-', 'm')}", pattern="M-M*-ME*",
                        seed=3, num_nextn_predict_layers=1, mtp_pattern=mtp_pattern)
    llm = LLM(target, dtype="float32", device="cpu", max_num_seqs=4,
              speculative_config=SpeculativeConfig("mtp", 2, adaptive=False))
    d = llm.engine.drafter
    assert d.mtp.num_attention_layers == mtp_pattern.count("*")
    checked = []
    orig = MTPDrafter.propose

    def compare(self, ctx):                              # every step: prefill, mixed and decode
        fb = ctx.forward_batch
        tokens = self.pair_tokens(ctx)
        caches = list(self.kv.k) + list(self.kv.v)
        before = [t.clone() for t in caches]
        self._step(tokens, ctx.hidden, fb)               # the full pass (all rows)
        full = [t.clone() for t in caches]
        for t, saved in zip(caches, before):
            t.copy_(saved)
        assert self.follow(tokens, ctx.hidden, fb) is None
        for t, want in zip(caches, full):
            assert torch.equal(t, want)
        assert any(not torch.equal(t, was) for t, was in zip(full, before))
        for t, saved in zip(caches, before):             # the step goes on from where it was
            t.copy_(saved)
        checked.append((fb.mamba.num_decode_rows, fb.mamba.num_prefill_rows))
        return orig(self, ctx)
    monkeypatch.setattr(MTPDrafter, "propose", compare)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 200, n).tolist() for n in (9, 14, 5, 11)]
    eng = llm.engine
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    reqs = [eng.make_request(p, params) for p in prompts]
    for r in reqs[:3]:
        eng.add_request(r)
    for _ in range(3):
        eng.step()
    eng.add_request(reqs[3])                              # arrives while the others decode
    while eng.has_work():
        eng.step()
    assert (0, 3) in checked and (3, 0) in checked, checked          # the first prefill; decode of 3 rows
    assert any(d and p for d, p in checked), checked                  # a mixed step: the arrival's prefill


def test_write_kv_only_is_forwards_cache_write_with_rope():
    """``Attention.write_kv_only`` with RoPE and a key scale (paths the published MTP blocks do not
    take): exactly the cache rows ``forward`` writes, and no other row."""
    from types import SimpleNamespace

    from hybrid_engine.attention import KVCache
    from hybrid_engine.models.nemotron_h import Attention, Caches
    from hybrid_engine.step.forward_batch import AttnMetadata, ForwardBatch

    # the fields Attention reads
    cfg = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_scale=None,
                          hidden_size=32, attention_bias=True, rotary_dim=8, rope_theta=10000.0)
    torch.manual_seed(0)
    attn = Attention(cfg, 0, key_scale=0.7)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.5)
    t = 5
    x = torch.randn(t, 32)
    kv = KVCache(1, 4, 4, 2, 8, torch.float32, "cpu")
    slots = torch.tensor([4, 5, 6, 7, 8])                      # blocks 1 and 2
    attn_md = AttnMetadata(query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                           seq_lens=torch.tensor([t], dtype=torch.int32),
                           block_tables=torch.tensor([[1, 2]], dtype=torch.int32), slot_mapping=slots,
                           max_query_len=t, max_seq_len=t)
    fb = ForwardBatch(torch.zeros(t, dtype=torch.int64), torch.arange(3, 3 + t), attn_md, None, None)
    attn(x, fb, Caches(kv, None))
    rows = lambda c: c.reshape(-1, 2, 8)                       # noqa: E731  [slot, heads, head_dim]
    full = (rows(kv.k[0])[slots].clone(), rows(kv.v[0])[slots].clone())
    kv.k[0].fill_(float("nan"))
    kv.v[0].fill_(float("nan"))
    attn.write_kv_only(x, fb, Caches(kv, None))
    assert torch.equal(rows(kv.k[0])[slots], full[0]) and torch.equal(rows(kv.v[0])[slots], full[1])
    others = torch.ones(16, dtype=torch.bool)
    others[slots] = False
    assert torch.isnan(rows(kv.k[0])[others]).all() and torch.isnan(rows(kv.v[0])[others]).all()
    # the key scale and RoPE matter here: without them the written keys differ
    plain = attn.k_proj(x).view(t, 2, 8)
    assert not torch.allclose(rows(kv.k[0])[slots], plain)


@pytest.mark.parametrize("mtp_pattern", ["*E", "*-*E"])
def test_a_decode_rows_drafts_do_not_depend_on_a_prefill_beside_it(model_dirs, monkeypatch, mtp_pattern):
    """After a step with prefill rows the drafter writes the MTP KV with ``follow`` and takes draft
    1 as a single-token step; after a decode-only step it runs the pass over the step's tokens.
    A decoding request must get the same drafts at every position either way: alone (decode-only
    steps) and beside a request that arrives and prefills in chunks (mixed steps)."""
    target = model_dirs(f"mtp_follow_{mtp_pattern.replace('*', 'a').replace('-', 'm')}", pattern="M-M*-ME*",
                        seed=3, num_nextn_predict_layers=1, mtp_pattern=mtp_pattern)
    rng = np.random.default_rng(11)
    first, arrival = rng.integers(3, 200, 10).tolist(), rng.integers(3, 200, 23).tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    orig = MTPDrafter.propose

    def drafts_of_first(with_arrival: bool) -> dict:
        # forced acceptance (coins keyed by slot and position, the same in both runs): verify rows
        # keep 1-3 tokens, so the newest pair sits at every offset of a row
        llm = LLM(target, dtype="float32", device="cpu", max_num_seqs=2, max_num_batched_tokens=8,
                  speculative_config=SpeculativeConfig("mtp", 2, adaptive=False, forced_acceptance_rate=0.6))
        eng = llm.engine
        req = eng.make_request(first, params)
        seen, mixed = {}, []

        def record(self, ctx):
            drafts, probs = orig(self, ctx)
            rows = [i for i, r in enumerate(ctx.req_ids) if r == req.request_id]
            if rows and int(ctx.num_valid[rows[0]]) > 0:
                seen[int(ctx.input_pos[rows[0]])] = drafts[rows[0]].tolist()
                if ctx.forward_batch.mamba.num_prefill_rows and bool(ctx.is_decode[rows[0]]):
                    mixed.append(int(ctx.input_pos[rows[0]]))
            return drafts, probs
        monkeypatch.setattr(MTPDrafter, "propose", record)
        eng.add_request(req)
        for _ in range(2):
            eng.step()
        if with_arrival:                                 # prefills in 8-token chunks beside the decode row
            eng.add_request(eng.make_request(arrival, params))
        while eng.has_work():
            eng.step()
        monkeypatch.setattr(MTPDrafter, "propose", orig)
        return seen, mixed

    alone, none_mixed = drafts_of_first(False)
    beside, mixed = drafts_of_first(True)
    assert not none_mixed and len(mixed) >= 2, mixed     # the second run really drafted in mixed steps
    steps = sorted(alone)
    assert {b - a for a, b in zip(steps, steps[1:])} >= {1, 2}, steps   # rows kept 1 and 2+ tokens
    assert set(mixed) <= set(alone)
    assert {p: beside[p] for p in mixed} == {p: alone[p] for p in mixed}
    assert beside == alone
