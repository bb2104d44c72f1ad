"""Prefix caching end to end (docs/design.md, "Prefix caching", invariants 13 and 14).

A fuzzed multi-turn chat workload (shared system prompts, conversations that branch from another
one's earlier turn, each turn's prompt = the previous prompt + its reply + new user tokens) runs
on tiny KV / checkpoint pools (evictions, preemption) with caching on and off, for every drafter,
async and sync: greedy tokens equal transformers' and each other's, hits really happen, and every
block reference and checkpoint pin is returned at the end.
"""
import os

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hf_reference import hf_greedy

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
MAX_TOKENS = 4
BS = 4


def make_spec(name, model_dir):
    return {"nospec": None, "ngram3": SpeculativeConfig("ngram", 3),
            "draft_model2": SpeculativeConfig("draft_model", 2, model=str(model_dir)),
            "mtp2": SpeculativeConfig("mtp", 2)}[name]


def make_engine(model_dir, *, on, spec=None, async_scheduling=True, blocks=40, budget=16, rows_bytes=None,
                seqs=4, interval=2, quantization=None):
    kw = {} if rows_bytes is None else {"mamba_checkpoint_bytes": rows_bytes}
    if quantization is not None:
        kw["quantization"] = quantization
    return LLM(model_dir, dtype="float32", device=DEV, max_num_seqs=seqs, max_num_batched_tokens=budget,
               block_size=BS, num_kv_blocks=blocks, speculative_config=spec, async_scheduling=async_scheduling,
               enable_prefix_caching=on, mamba_checkpoint_interval=interval, **kw)


def conversations(seed):
    """Waves of prompts: wave t holds turn t of every conversation. Two system prompts; the
    third conversation branches from the first after its first turn."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(13, 27, 2)]
    convs = [list(systems[0]), list(systems[1]), None, list(systems[0])]
    users = [[rng.integers(3, 256, int(rng.integers(2, 8))).tolist() for _ in range(3)] for _ in convs]
    return convs, users


def run_chat(llm, seed):
    """Drive three turns; returns {(conv, turn): (prompt, tokens, num_cached_tokens)}."""
    convs, users = conversations(seed)
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {}
    for turn in range(3):
        if turn == 1:
            convs[2] = list(convs[0])                  # branch: same history as conv 0, new user turn
        live = [i for i, c in enumerate(convs) if c is not None]
        prompts = [convs[i] + users[i][turn] for i in live]
        res = llm.generate(prompts, sp, use_tqdm=False)
        for i, p, o in zip(live, prompts, res):
            toks = o.outputs[0].token_ids
            out[(i, turn)] = (p, toks, o.num_cached_tokens)
            convs[i] = p + toks
    return out


def assert_drained(llm):
    eng = llm.engine
    sched = eng.scheduler
    assert sched.blocks.num_free == sched.blocks.num_total and sched.slots.num_free == sched.slots.num_total
    if sched.prefix.enabled:
        assert sched.blocks.num_referenced == 0
        assert all(sched.blocks.ref_count(b) == 0 for b in range(1, sched.blocks.num_blocks))
        assert sched.prefix.index.num_pinned == 0 and not sched.prefix._pending


@pytest.fixture(scope="module")
def refs(hybrid_dir):
    cache = {}

    def get(prompt):
        key = tuple(prompt)
        if key not in cache:
            cache[key] = hf_greedy(hybrid_dir, [list(prompt)], MAX_TOKENS)[0]
        return cache[key]
    return get


SLOW = pytest.mark.slow


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("spec_name", ["nospec", "ngram3", pytest.param("draft_model2", marks=SLOW),
                                       pytest.param("mtp2", marks=SLOW)])
def test_multi_turn_chat_equal_with_caching_on_and_off_and_transformers(spec_name, async_scheduling, hybrid_dir,
                                                                         refs):
    spec = make_spec(spec_name, hybrid_dir)
    # 29 blocks of 4 tokens for 4 conversations of up to ~60 tokens, checkpoint rows for 10
    # boundaries: blocks and checkpoints are evicted while others are shared. (Every config
    # produces the same prompts, so transformers runs once per prompt for the whole matrix.)
    on = make_engine(hybrid_dir, on=True, spec=spec, async_scheduling=async_scheduling, blocks=30, rows_bytes=320_000)
    off = make_engine(hybrid_dir, on=False, spec=spec, async_scheduling=async_scheduling, blocks=30)
    a, b = run_chat(on, 0), run_chat(off, 0)
    for key in a:
        assert a[key][:2] == b[key][:2], f"{key}: caching on != off"
        assert a[key][1] == refs(a[key][0]), f"{key}: != transformers"
    assert_drained(on)
    assert_drained(off)
    st = on.engine.stats(expert_load=False)
    assert sum(v[2] > 0 for v in a.values()) >= 3 and st["prefix_cache_hit_tokens"] > 0
    assert st["prefix_cache_block_evictions"] > 0          # the small pool really evicts
    assert 0 < st["mamba_checkpoints_total"] < 29


@pytest.mark.parametrize("quantization", ["fp8", "nvfp4"])
def test_quantized_weights_compose_with_caching(quantization, hybrid_dir):
    """Weights quantized at load, routed experts included (FP8, NVFP4): the chat workload gives
    the same greedy tokens with caching on and off (no transformers reference: the weights are
    not the checkpoint's), with hits, evictions and every pin returned."""
    on = make_engine(hybrid_dir, on=True, blocks=30, rows_bytes=320_000, quantization=quantization)
    off = make_engine(hybrid_dir, on=False, blocks=30, quantization=quantization)
    kinds = {type(m).__name__ for m in on.engine.model.modules()}          # the weights really are quantized
    assert {"fp8": "Fp8Linear", "nvfp4": "Nvfp4Linear"}[quantization] in kinds, kinds
    expert_dtypes = {p.dtype for n, p in on.engine.model.named_parameters() if n.endswith("experts.up_proj")}
    assert expert_dtypes == ({torch.float8_e4m3fn} if quantization == "fp8" else {torch.uint8}), expert_dtypes
    a, b = run_chat(on, 1), run_chat(off, 1)
    assert a.keys() == b.keys()
    for key in a:
        assert a[key][:2] == b[key][:2], f"{key}: caching on != off"
    assert_drained(on)
    st = on.engine.stats(expert_load=False)
    assert sum(v[2] > 0 for v in a.values()) >= 3 and st["prefix_cache_hit_tokens"] > 0
    assert st["prefix_cache_block_evictions"] > 0          # the small pool really evicts


def test_preemption_and_eviction_pressure(hybrid_dir, refs):
    """A pool so small that requests preempt each other while sharing cached blocks (the
    workload of the matrix above: the same prompts, so the transformers references are shared)."""
    on = make_engine(hybrid_dir, on=True, blocks=18, seqs=4, budget=12, rows_bytes=200_000)
    from hybrid_engine.scheduling import scheduler as sched_mod
    calls = []
    orig = sched_mod.Scheduler._preempt

    def spy(self, req):
        calls.append(req.request_id)
        return orig(self, req)
    sched_mod.Scheduler._preempt = spy
    try:
        a = run_chat(on, 0)
        for key, (p, toks, _) in a.items():
            assert toks == refs(p), key
        assert_drained(on)
    finally:
        sched_mod.Scheduler._preempt = orig
    assert calls, "the workload never preempted"
    assert on.engine.stats(expert_load=False)["prefix_cache_hits"] > 0


def test_hit_depth_is_independent_of_the_chunk_budget(hybrid_dir):
    """The same requests, one after another, hit the same depths at budgets 6 and 64."""
    rng = np.random.default_rng(7)
    system = rng.integers(3, 256, 29).tolist()
    prompts = [system + rng.integers(3, 256, int(n)).tolist() for n in (3, 9, 1, 14)]
    prompts.append(prompts[1] + [5, 6, 7, 8, 9, 10])
    depths = {}
    for budget in (6, 64):
        llm = make_engine(hybrid_dir, on=True, budget=budget, blocks=64)
        depths[budget] = [llm.generate([p], SamplingParams(max_tokens=2, ignore_eos=True),
                                       use_tqdm=False)[0].num_cached_tokens for p in prompts]
    assert depths[6] == depths[64]
    assert depths[6][1] == 24 and depths[6][4] == 36      # every 2 blocks; the last full block of prompt 1


@pytest.mark.parametrize("spec_name", ["nospec", "mtp2"])
@pytest.mark.parametrize("system_len", [27, 32])
def test_a_shared_prefix_is_restored_where_requests_diverge(spec_name, system_len, hybrid_dir, refs):
    """Checkpoints every 4 blocks (16 tokens). The second request sharing a system prompt restores
    the deepest interval checkpoint and saves one where its cached KV blocks end; the third restores
    there. With MTP the blocks hash one token ahead, so a 32-token prompt's last block is not shared
    and the divergence point is 28, where no interval boundary lies."""
    rng = np.random.default_rng(11)
    system = rng.integers(3, 256, system_len).tolist()
    prompts = [system + rng.integers(3, 256, 5).tolist() for _ in range(4)]
    llm = make_engine(hybrid_dir, on=True, spec=make_spec(spec_name, hybrid_dir), blocks=64, interval=4)
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    depths = [o.num_cached_tokens for o in outs]
    expected = {("nospec", 27): [0, 16, 24, 24], ("nospec", 32): [0, 32, 32, 32],
                ("mtp2", 27): [0, 16, 24, 24], ("mtp2", 32): [0, 16, 28, 28]}[(spec_name, system_len)]
    assert depths == expected
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == refs(p)
    assert_drained(llm)


def _slot_state(engine, slot):
    pool, w = engine.caches.mamba, engine.cfg.model.conv_kernel - 1
    return [(c[slot, :, :w].clone(), s[slot, 0].clone()) for c, s in zip(pool.conv_state, pool.ssm_state)]


def _row_state(engine, row):
    ck = engine.caches.checkpoints
    return [(c[row].clone(), s[row].clone()) for c, s in zip(ck.conv, ck.ssm)]


def test_checkpoint_and_restore_are_exact(hybrid_dir):
    """(1) A chunk that ends at a boundary saves, bit for bit, the state its slot holds after the
    chunk; (2) a restore puts exactly that state into the new request's slot; (3) it agrees to
    float32 rounding with the state a prefill of exactly those tokens computes from scratch."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 256, 30).tolist()
    llm = make_engine(hybrid_dir, on=True, budget=16, blocks=64, async_scheduling=False)
    eng = llm.engine
    req = eng.make_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    eng.add_request(req)
    eng.step()                                             # chunk [0, 16): its end is a boundary
    ix = eng.scheduler.prefix.index
    h16 = eng.scheduler.prefix.hashes(req)[3]
    row = ix.get(h16)
    assert row is not None
    saved = _row_state(eng, row)
    for (cw, cs), (rw, rs) in zip(_slot_state(eng, req.slot), saved):
        assert torch.equal(cw, rw) and torch.equal(cs, rs)
    while eng.has_work():
        eng.step()
    # (2) a second request shares the first 16 tokens (and only those): it restores row
    seen = []
    ck = eng.caches.checkpoints
    orig = ck.restore

    def spy(pool, slots, rows):                            # one call restores every layer
        orig(pool, slots, rows)
        w = ck.conv[0].shape[-1]
        seen.extend((layer, rows.tolist(), conv[slots, :, :w].clone(), ssm[slots, 0].clone())
                    for layer, (conv, ssm) in enumerate(zip(pool.conv_state, pool.ssm_state)))
    ck.restore = spy
    other = prompt[:16] + [7, 8, 9]
    out = llm.generate([other], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == 16
    assert len(seen) == len(saved) == len(eng.caches.mamba.conv_state)
    for layer, rows, conv, ssm in seen:
        assert rows == [row]
        assert torch.equal(conv[0], saved[layer][0]) and torch.equal(ssm[0], saved[layer][1])
    assert_drained(llm)
    # (3) from scratch: a prefill of exactly prompt[:16] on an engine without caching
    ref = make_engine(hybrid_dir, on=False, budget=16, blocks=64, async_scheduling=False).engine
    r = ref.make_request(prompt[:16], SamplingParams(max_tokens=2, ignore_eos=True))
    ref.add_request(r)
    ref.step()                                             # the prefill; the decode step has not run
    for (cw, cs), (rw, rs) in zip(_slot_state(ref, r.slot), saved):
        torch.testing.assert_close(rw, cw, rtol=0, atol=1e-6)
        torch.testing.assert_close(rs, cs, rtol=1e-5, atol=1e-6)
    while ref.has_work():
        ref.step()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_faults_with_caching_end_only_their_step_and_leak_nothing(hybrid_dir, monkeypatch, async_scheduling):
    """Faults injected at random step phases (chaos_harness) on a shared-prefix workload with
    caching on: a request either fails naming the fault or equals its fault-free run; blocks,
    references, checkpoint pins and pending saves all return; a step that failed publishes
    nothing that a later request restores wrongly (the probe after it is exact)."""
    from chaos_harness import PHASES, Injector, drive
    from test_chaos import check_against_clean
    llm = make_engine(hybrid_dir, on=True, async_scheduling=async_scheduling, seqs=2, budget=12, blocks=48)
    eng = llm.engine
    rng = np.random.default_rng(21 + async_scheduling)
    system = rng.integers(3, 256, 18).tolist()

    def workload(prefix):
        return [(int(rng.integers(0, 6)), system + rng.integers(3, 256, int(rng.integers(1, 9))).tolist(),
                 SamplingParams(max_tokens=int(rng.integers(1, 6)), ignore_eos=True), f"{prefix}-{i}")
                for i in range(4)]
    inj = Injector(eng, monkeypatch)
    fired = failed = 0
    for run in range(3):
        wl = workload(f"r{run}")
        clean = drive(eng, wl)
        assert_drained(llm)
        plan = {int(s): str(rng.choice(PHASES)) for s in rng.integers(0, 10, 2)}
        n0 = len(inj.fired)
        faulty = drive(eng, wl, inj, plan)
        assert_drained(llm)
        failed += check_against_clean(clean, faulty, inj.fired, n0)
        fired += len(inj.fired) - n0
    assert fired and failed
    probe = system + [7, 7, 7]
    out = llm.generate([probe], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens > 0 and out.outputs[0].token_ids == hf_greedy(hybrid_dir, [probe], 4)[0]
    assert_drained(llm)


def test_with_mtp_a_prompt_ending_on_a_block_boundary_saves_its_last_hashable_block(hybrid_dir):
    """MTP hashes a block with the token after it, so a prompt whose length is a multiple of the
    block size cannot hash its last block: it saves its end one block earlier, and the next turn
    restores there (before, it saved no end and the next turn restored a turn further back).
    Greedy tokens equal transformers'."""
    from hybrid_engine import SpeculativeConfig
    llm = make_engine(hybrid_dir, on=True, spec=SpeculativeConfig("mtp", 2), blocks=600, interval=64)
    rng = np.random.default_rng(3)
    convo = rng.integers(3, 256, 2 * BS).tolist()
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    prev_len = None
    for turn in range(4):
        prompt = convo + rng.integers(3, 256, (-(len(convo)) % BS) or BS).tolist()   # ends on a boundary
        assert len(prompt) % BS == 0
        out = llm.generate([prompt], sp, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(hybrid_dir, [prompt], 3)[0], turn
        if prev_len is not None:
            assert out.num_cached_tokens == prev_len - BS, (turn, out.num_cached_tokens, prev_len)
        prev_len = len(prompt)
        convo = prompt + out.outputs[0].token_ids
    assert_drained(llm)


def test_each_turn_restores_where_the_previous_turn_ended_with_a_small_pool(hybrid_dir):
    """Four conversations over one system prompt take turns, one request at a time, on a pool of
    7 checkpoint rows with a checkpoint every 2 blocks: every turn saves two or three checkpoints,
    but only its last one is needed (by the same conversation's next turn). Evicting checkpoints
    on a straight chain first keeps the four chain ends and the shared system prompt, so every
    later turn restores the end of its previous prompt. (Under plain LRU only 2 of the 12 did.)"""
    llm = make_engine(hybrid_dir, on=True, blocks=600, rows_bytes=1)
    row_bytes = llm.engine.stats(expert_load=False)["mamba_checkpoint_bytes"]
    llm = make_engine(hybrid_dir, on=True, blocks=600, rows_bytes=7 * row_bytes)
    assert llm.engine.stats(expert_load=False)["mamba_checkpoints_total"] == 7
    rng = np.random.default_rng(0)
    system = rng.integers(3, 256, 10).tolist()
    convs, ends = [list(system) for _ in range(4)], {}
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    restored = []
    for turn in range(4):
        for i in range(4):
            prompt = convs[i] + rng.integers(3, 256, int(rng.integers(3, 8))).tolist()
            out = llm.generate([prompt], sp, use_tqdm=False)[0]
            if turn:
                restored.append((out.num_cached_tokens, ends[i]))
            ends[i] = len(prompt) // BS * BS           # its last full block: saved by this turn
            convs[i] = prompt + out.outputs[0].token_ids
    assert all(got >= end for got, end in restored), restored
    assert_drained(llm)


def test_ckpt_tokens_sorted(hybrid_dir, monkeypatch):
    """A step's checkpoint saves come sorted by packed token (the fused SSD pass's emits rely on
    it: each program binary-searches its sequence's first emit), across rows and within a row,
    on a step that prefills several rows each crossing several boundaries."""
    import hybrid_engine.step.plans.mixed as mixed
    seen = []
    orig = mixed._prefix_cache_arrays

    def spy(*a, **kw):
        out = orig(*a, **kw)
        if "ckpt_token" in out:
            seen.append((out["ckpt_seq"].copy(), out["ckpt_token"].copy()))
        return out
    monkeypatch.setattr(mixed, "_prefix_cache_arrays", spy)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 256, n).tolist() for n in (21, 35, 17)]
    llm = make_engine(hybrid_dir, on=True, budget=64, blocks=64, seqs=4, interval=1)
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert seen
    for seq, tok in seen:
        assert (np.diff(tok) >= 0).all() and (np.diff(seq) >= 0).all(), (seq, tok)
    # the case that matters happened: rows with several saves each, in one step
    assert any(len(set(seq.tolist())) >= 2 and np.bincount(seq).max() >= 2 for seq, _ in seen)
    assert_drained(llm)
