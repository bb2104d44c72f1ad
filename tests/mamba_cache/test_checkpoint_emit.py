"""Prefix-cache checkpoints taken from the scan's own intermediates (docs/design.md invariant 14):
``ssd_scan_varlen(..., emit_at=...)`` and ``conv_windows_at`` against the float64 oracles, and
bit for bit against a from-scratch scan / conv that stops at the boundary."""
import torch

from hybrid_engine.mamba_cache.ops import (
    causal_conv1d_varlen_ref,
    conv_windows_at,
    conv_windows_before,
    conv_windows_before_ref,
    ssd_scan_varlen,
    ssd_scan_varlen_pooled,
    ssd_scan_varlen_ref,
)
from oracles import close, dt64, qsl_of, ssm_params, ssm_seq64


def _inputs(T, H, G, P, N, gen):
    x = torch.randn(T, H, P, generator=gen)
    dt_raw = torch.randn(T, H, generator=gen)
    dt_bias, A, D = ssm_params(H, G, N, P, gen)
    B = torch.randn(T, G, N, generator=gen)
    C = torch.randn(T, G, N, generator=gen)
    return x, dt_raw, dt_bias, A, B, C, D


def test_emitted_states_equal_the_sequential_recurrence():
    gen = torch.Generator().manual_seed(3)
    H, G, P, N, chunk = 4, 2, 3, 5, 8
    lens = [21, 7, 16]
    x, dt_raw, dt_bias, A, B, C, D = _inputs(sum(lens), H, G, P, N, gen)
    init = torch.randn(len(lens), H, P, N, generator=gen)
    qsl = qsl_of(lens, torch.int64)
    # tokens inside chunks, at chunk ends, the first and the last token of a sequence
    emit = torch.tensor([0, 3, 7, 8, 15, 20, 21, 27, 28, 35, 43], dtype=torch.int64)
    seq = torch.searchsorted(qsl[1:], emit, right=True)
    y, fin, states = ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, qsl, init, chunk, emit_at=emit)
    y0, fin0 = ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, qsl, init, chunk)
    assert torch.equal(y, y0) and torch.equal(fin, fin0)          # emitting changes nothing else
    dt = dt64(dt_raw, dt_bias)
    st = qsl.tolist()
    for m, t in enumerate(emit.tolist()):
        b = int(seq[m])
        a = st[b]
        _, hs = ssm_seq64(init[b], x[a:t + 1], dt[a:t + 1], A, B[a:t + 1], C[a:t + 1], D)
        close(states[m], hs[-1], 1e-5)


def test_emitted_state_at_a_sequence_end_is_bitwise_its_final_state():
    """The state emitted after a sequence's last token is, bit for bit, the final state the state
    pass returns (the same terms in the same order), and a scan that stops at the boundary agrees
    to float32 rounding. (Bit equality across scans of different lengths is not a property of
    float32 CPU kernels: vectorised elementwise ops round a tensor's tail lanes differently.)"""
    gen = torch.Generator().manual_seed(4)
    H, G, P, N, chunk = 4, 2, 8, 16, 16
    lens = [53, 16, 7, 32]
    x, dt_raw, dt_bias, A, B, C, D = _inputs(sum(lens), H, G, P, N, gen)
    init = torch.randn(len(lens), H, P, N, generator=gen)
    qsl = qsl_of(lens, torch.int64)
    _, fin, states = ssd_scan_varlen_ref(x, dt_raw, dt_bias, A, B, C, D, qsl, init, chunk, emit_at=qsl[1:] - 1)
    assert torch.equal(states, fin)
    L = lens[0]
    _, _, inner = ssd_scan_varlen_ref(x[:L], dt_raw[:L], dt_bias, A, B[:L], C[:L], D, qsl_of([L], torch.int64),
                                      init[:1], chunk, emit_at=torch.tensor([3, 15, 19, 31, 47]))
    for m, q in enumerate([4, 16, 20, 32, 48]):
        _, short = ssd_scan_varlen_ref(x[:q], dt_raw[:q], dt_bias, A, B[:q], C[:q], D, qsl_of([q], torch.int64),
                                       init[:1], chunk)
        close(inner[m], short[0], 1e-6)


def test_conv_windows_at_equal_the_window_a_conv_leaves():
    """The window after token t equals the conv state a prefill ending at t leaves (bit for bit),
    including boundaries closer to the chunk start than W-1 (they read the initial window)."""
    gen = torch.Generator().manual_seed(5)
    Cdim, W = 6, 4
    lens = [9, 2, 5]
    T = sum(lens)
    x = torch.randn(T, Cdim, generator=gen)
    weight = torch.randn(Cdim, W, generator=gen)
    windows = torch.randn(len(lens), Cdim, W - 1, generator=gen)
    has_init = torch.tensor([True, True, False])
    qsl = qsl_of(lens, torch.int64)
    emit = torch.tensor([0, 1, 5, 8, 9, 10, 11, 15], dtype=torch.int64)
    seq = torch.searchsorted(qsl[1:], emit, right=True)
    init = windows * has_init.view(-1, 1, 1)
    got = conv_windows_at(x, init[seq], qsl, seq, emit)
    for m, t in enumerate(emit.tolist()):
        b = int(seq[m])
        a = int(qsl[b])
        state = torch.zeros(2, Cdim, W - 1)
        state[1] = windows[b]
        causal_conv1d_varlen_ref(x[a:t + 1], weight, None, state, qsl_of([t + 1 - a], torch.int64),
                                 torch.tensor([1]), has_init[b:b + 1])
        assert torch.equal(got[m], state[1]), f"token {t}"


def test_checkpoint_ops_never_read_device_data_on_the_host():
    """The ops a saving / restoring step adds (window gather, emit of the Triton path, checkpoint
    save and restore) run under the no-host-sync guard (docs/design.md invariant 8)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from hf_reference import NoHostSync
    from hybrid_engine.mamba_cache.checkpoints import MambaCheckpoints
    from hybrid_engine.mamba_cache.pool import MambaPool
    gen = torch.Generator().manual_seed(6)
    H, G, P, N, Cdim, W, cs = 4, 2, 3, 5, 6, 4, 8
    T = 19
    x, dt_raw, dt_bias, A, B, C, D = _inputs(T, H, G, P, N, gen)
    qsl = qsl_of([12, 7], torch.int64)
    emit = torch.tensor([3, 11, 15])
    seq = torch.tensor([0, 0, 1])
    ck = MambaCheckpoints(1, 4, Cdim, W, H, P, N, torch.float32, torch.device("cpu"))
    pool = MambaPool(1, 2, Cdim, W, H, P, N, 2, torch.float32, torch.device("cpu"))   # 3 slots, K = 2
    conv_state, ssm_state = pool.conv_state[0], pool.ssm_state[0]
    ssm_state.copy_(torch.randn(ssm_state.shape, generator=gen))
    slots, has_init, rows = torch.tensor([1, 2]), torch.tensor([True, False]), torch.tensor([0, 2, 3])
    xc, cpool = torch.randn(T, Cdim, generator=gen), torch.randn(3, Cdim, W - 1 + 2, generator=gen)
    # what lands in the checkpoint rows: the windows and the states after the emit tokens
    want_conv, want_ssm = torch.zeros_like(ck.conv[0]), torch.zeros_like(ck.ssm[0])
    want_conv[rows] = conv_windows_before_ref(xc, cpool, W, qsl, slots, has_init, seq, emit)
    init = torch.where(has_init.view(-1, 1, 1, 1), ssm_state[slots, 0], 0.0)
    want_ssm[rows] = ssd_scan_varlen_ref(x, dt_raw, dt_bias, A, B, C, D, qsl, init, cs, emit_at=emit)[2]
    # the scan's emits into checkpoint rows (outside the guard: with a CPU query_start_loc the
    # reference sizes its grid exactly from it, which reads it; the mixer's is on the device)
    ssd_scan_varlen_pooled(x, dt_raw, dt_bias, A, B, C, D, qsl, ssm_state[:, 0], slots, has_init, cs,
                           emit_at=emit, emit_out=ck.ssm[0], emit_rows=rows)
    with NoHostSync():
        conv_windows_at(torch.randn(T, Cdim), torch.zeros(3, Cdim, W - 1), qsl, seq, emit)
        conv_windows_before(xc, cpool, W, qsl, slots, has_init, seq, emit, out=ck.conv[0], out_rows=rows)
    assert torch.equal(ck.conv[0], want_conv)                  # rows 0, 2, 3 written, row 1 untouched
    assert torch.equal(ck.ssm[0], want_ssm)
    with NoHostSync():
        ck.restore(pool, torch.tensor([1, 2]), torch.tensor([2, 0]))
    assert torch.equal(conv_state[1, :, :W - 1], ck.conv[0][2]) and torch.equal(ssm_state[2, 0], ck.ssm[0][0])
    emit_mod = __import__("pytest").importorskip("hybrid_engine.mamba_cache.ops.triton_ssd_emit")
    NC, BL = 4, 16
    meta = torch.tensor([[0, 8], [8, 4], [12, 7], [19, 0]], dtype=torch.int32)
    cum = torch.tensor([2, 3], dtype=torch.int32)
    with NoHostSync():
        out = emit_mod.emit_states_ref(x, B, qsl, cum, meta, torch.rand(NC, H, BL), -torch.rand(NC, H, BL),
                                       torch.randn(NC, H, P, N), emit, cs)
    assert out.shape == (3, H, P, N) and torch.isfinite(out).all()


def test_restore_writes_every_layers_slot_and_nothing_else():
    """One restore call fills, in every Mamba layer, the given slots' conv window columns 0..W-2
    and SSM checkpoint 0 from the given rows; the window's spec columns, checkpoints 1..K and the
    other slots keep their values (the per-layer loop it replaced, written out here)."""
    from hybrid_engine.mamba_cache.checkpoints import MambaCheckpoints
    from hybrid_engine.mamba_cache.pool import MambaPool
    gen = torch.Generator().manual_seed(11)
    L, H, P, N, Cdim, W, K = 3, 2, 3, 4, 5, 4, 2
    ck = MambaCheckpoints(L, 5, Cdim, W, H, P, N, torch.float32, torch.device("cpu"))
    pool = MambaPool(L, 4, Cdim, W, H, P, N, K, torch.float32, torch.device("cpu"))      # 5 slots
    for t in (ck.conv_all, ck.ssm_all, pool.conv_all, pool.ssm_all):
        t.copy_(torch.randn(t.shape, generator=gen))
    want_conv = [c.clone() for c in pool.conv_state]
    want_ssm = [s.clone() for s in pool.ssm_state]
    slots, rows = torch.tensor([3, 1]), torch.tensor([4, 0])
    for layer in range(L):
        for s, r in zip(slots.tolist(), rows.tolist()):
            want_conv[layer][s, :, :W - 1] = ck.conv[layer][r]
            want_ssm[layer][s, 0] = ck.ssm[layer][r]
    ck.restore(pool, slots, rows)
    for layer in range(L):
        assert torch.equal(pool.conv_state[layer], want_conv[layer])
        assert torch.equal(pool.ssm_state[layer], want_ssm[layer])
    # the per-layer lists are views of the stacked tensors: a write through one shows in the other
    pool.ssm_state[1][2, 1].fill_(7.0)
    assert torch.equal(pool.ssm_all[1, 2, 1], torch.full((H, P, N), 7.0))
