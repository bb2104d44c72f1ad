"""The deferred state update (CONTRACT item 4b) on CPU: a spec engine's pool keeps one SSM state
a slot and the pending inputs of the last verify's other tokens; the next step replays the
accepted ones. The reference equals the checkpointed form bit for bit (y and states) over random
steps; the pool's layout, copies and errors; and an engine on a deferred pool generates exactly
what the same engine on a checkpointed pool does. The Triton kernel's cases are in
tests/gpu/interpret_cases.py (``ssu_deferred``) and tests/gpu/test_kernels_ssu_norm.py."""
import pytest
import torch

from hybrid_engine.mamba_cache.ops import selective_state_update_gated_ref, selective_state_update_ref
from hybrid_engine.mamba_cache.ops.state_update import PendingInputs, pending_blocks, ssu_block_p
from hybrid_engine.mamba_cache.pool import MambaPool
from ssu_deferred_cases import check_ssu_deferred


@pytest.mark.parametrize("K", [1, 3, 4])
@pytest.mark.parametrize("seed", [0, 1])
def test_reference_deferred_is_the_checkpointed_bit_for_bit(K, seed):
    """Rows change order between steps; 7 rows x 9 heads put (slot, head) elements in CPU vector
    bodies and tails (a replay computing dt where the rows sit now, not where the verify had
    them, differed by ~2e-7 in most seeds); P = 40 at d_state 128 has 3 copies of dt and B."""
    check_ssu_deferred(selective_state_update_ref, "cpu", torch.float32, 6, K, steps=6, seed=seed)
    check_ssu_deferred(selective_state_update_ref, "cpu", torch.float32, 7, K, H=9, G=3, P=4, Nst=8,
                       steps=6, seed=seed)
    check_ssu_deferred(selective_state_update_ref, "cpu", torch.bfloat16, 4, K, H=6, G=3, P=12, Nst=8,
                       dt_limit=(0.01, 0.4), seed=seed)
    check_ssu_deferred(selective_state_update_ref, "cpu", torch.float16, 3, K, H=2, G=1, P=40, Nst=128,
                       steps=4, seed=seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reference_gated_deferred_is_the_checkpointed_bit_for_bit(dtype):
    check_ssu_deferred(selective_state_update_gated_ref, "cpu", dtype, 5, 3, gated=True, seed=3)


def test_the_check_fails_when_a_replay_is_wrong(monkeypatch):
    """The deferred check catches a replay that stops one token short (it cannot pass vacuously)."""
    from hybrid_engine.mamba_cache.ops import state_update as su
    real = su._replay

    def short(ssm_state, pending, slots, num_accepted, *a):
        return real(ssm_state, pending, slots, (num_accepted - 1).clamp(min=1), *a)
    monkeypatch.setattr(su, "_replay", short)
    with pytest.raises(AssertionError, match="deferred y differs"):
        check_ssu_deferred(selective_state_update_ref, "cpu", torch.float32, 6, 3, steps=6)


def test_pending_blocks_follow_the_kernel_tile():
    # one copy of dt and B per program (head_dim block) of the Triton kernel
    assert ssu_block_p(64, 128) == 16 and pending_blocks(64, 128) == 4
    assert pending_blocks(40, 128) == 3 and pending_blocks(16, 16) == 1
    pytest.importorskip("triton")
    from hybrid_engine.mamba_cache.ops.triton_state_update import _config
    for P, N in ((64, 128), (40, 128), (16, 16), (12, 8), (64, 64)):
        assert _config(P, N, 1)[0] == ssu_block_p(P, N)


def test_pool_layout_and_fork_copy():
    pool = MambaPool(2, 3, 24, 4, 3, 40, 128, 2, torch.bfloat16, torch.device("cpu"), deferred=True)
    assert pool.ssm_all.shape == (2, 4, 1, 3, 40, 128)
    p = pool.pending[1]
    assert p.x.shape == (4, 2, 3, 40) and p.dt.shape == (4, 2, 3, 3) and p.B.shape == (4, 2, 3, 3, 128)
    assert p.x.dtype == torch.bfloat16
    per_layer = [t for i in range(2) for t in (pool.conv_state[i], pool.ssm_state[i], pool.pending[i].x,
                                               pool.pending[i].dt, pool.pending[i].B)]       # [S, ...] each
    for t in per_layer:
        t[2].normal_()
    pool.copy_slot(3, 2)
    for t in per_layer:
        assert torch.equal(t[3], t[2]) and t[3].abs().sum() > 0 and not t[1].any()
    plain = MambaPool(2, 3, 24, 4, 3, 40, 128, 2, torch.bfloat16, torch.device("cpu"))
    assert plain.pending == [None, None] and plain.ssm_all.shape[2] == 3


def _args(dtype, N=3, s=2, H=2, G=1, P=4, Nst=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, s, H, P, generator=g).to(dtype)
    dt = torch.randn(N, s, H, generator=g).to(dtype)
    B = torch.randn(N, s, G, Nst, generator=g).to(dtype)
    C = torch.randn(N, s, G, Nst, generator=g).to(dtype)
    return x, dt, torch.zeros(H), -torch.ones(H), B, C, torch.ones(H), torch.arange(1, N + 1), torch.ones(N, dtype=torch.int64)


def test_errors_name_what_is_wrong_before_the_pool_is_touched():
    S, K, H, P, Nst = 4, 2, 2, 4, 4
    nb = pending_blocks(P, Nst)
    pending = PendingInputs(x=torch.zeros(S, K, H, P), dt=torch.zeros(S, K, H, nb), B=torch.zeros(S, K, H, nb, Nst))
    state = torch.zeros(S, 1, H, P, Nst)
    with pytest.raises(TypeError, match="x is torch.bfloat16 but the deferred pool stores torch.float32"):
        selective_state_update_ref(state, *_args(torch.bfloat16), pending=pending)
    with pytest.raises(ValueError, match="4 tokens per row; a deferred pool of K=2 takes 1..3"):
        selective_state_update_ref(state, *_args(torch.float32, s=4), pending=pending)
    with pytest.raises(ValueError, match="keeps one state per slot"):
        selective_state_update_ref(torch.zeros(S, 3, H, P, Nst), *_args(torch.float32), pending=pending)
    with pytest.raises(ValueError, match="do not fit H=3"):
        selective_state_update_ref(torch.zeros(S, 1, 3, P, Nst), *_args(torch.float32, H=3), pending=pending)
    assert not state.any() and not any(t.any() for t in (pending.x, pending.dt, pending.B))


# ----------------------------------------------------------------------------- engine

CODE = ["def area(width, height):\n    return width * height\n\n\ndef area(width, height):\n",
        "import os\nimport sys\n\nfor name in sorted(os.listdir(path)):\n    print(name)\nfor name in sorted(",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Point"]


def _generate(target, spec, prompts, params, checkpointed: bool, monkeypatch):
    from hybrid_engine import LLM, device_side
    with monkeypatch.context() as m:
        if checkpointed:
            m.setattr(device_side, "MambaPool", lambda *a, deferred, **kw: MambaPool(*a, **kw))
        llm = LLM(target, speculative_config=spec, dtype="float32", device="cpu", max_num_seqs=3,
                  max_num_batched_tokens=32, max_model_len=256)
    pool = llm.engine.caches.mamba
    assert pool.deferred != checkpointed
    assert pool.ssm_all.shape[2] == (1 + spec.num_speculative_tokens if checkpointed else 1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm.stats()


@pytest.mark.parametrize("case", ["ngram-trained", "mtp-forced"])
def test_engine_on_a_deferred_pool_generates_what_a_checkpointed_pool_does(hybrid_dir, case, monkeypatch):
    """Greedy and seeded sampling: the same tokens and the same acceptance on a pool that keeps
    one state a slot as on one with 1+K checkpoints, with drafts accepted (so steps replayed
    pending tokens): n-gram drafts on the trained default model's code prompts, and MTP drafts
    under forced acceptance (benchmark only: accepted by a coin, so every count occurs)."""
    from hybrid_engine import SamplingParams, SpeculativeConfig
    from hybrid_engine.default_model import default_model_dir
    if case == "ngram-trained":
        target, spec, prompts = default_model_dir(), SpeculativeConfig("ngram", 3), CODE
    else:
        target, spec = hybrid_dir, SpeculativeConfig("mtp", 2, forced_acceptance_rate=0.7)
        prompts = [[179, 228] * 5, [170, 88, 54, 39, 250, 105, 178] * 3, [63, 5, 167, 65, 150] * 6]
    for params in (SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.0),
                   SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.8, seed=5)):
        deferred, stats_d = _generate(target, spec, prompts, params, False, monkeypatch)
        ckpt, stats_c = _generate(target, spec, prompts, params, True, monkeypatch)
        assert deferred == ckpt
        assert stats_d["drafts_accepted"] == stats_c["drafts_accepted"]
        assert stats_d["drafts_accepted"] > 0, "no draft accepted: nothing was replayed"
