"""mamba_cache.ops torch references vs independent per-token float64 implementations (CONTRACT.md)."""
import math

import pytest
import torch

from mamba_cache import NULL_SLOT
from mamba_cache.ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    gated_rmsnorm,
    selective_state_update,
    ssd_scan_naive,
    ssd_scan_varlen,
)

F64 = torch.float64


# ----------------------------------------------------------------------------- naive oracles (f64)

def silu64(v):
    return v / (1.0 + torch.exp(-v))


def dt64(dt_raw, dt_bias, dt_limit=(0.0, math.inf)):
    v = dt_raw.to(F64) + dt_bias.to(F64)
    sp = torch.where(v > 30, v, torch.log1p(torch.exp(v.clamp(max=30))))
    return sp.clamp(min=dt_limit[0], max=dt_limit[1])


def conv_seq64(window, xseq, weight, bias):
    """window [C, W-1], xseq [L, C] -> (out [L, C], full xs [C, W-1+L]); one token at a time."""
    W = weight.shape[1]
    xs = torch.cat([window.to(F64), xseq.to(F64).T], dim=1)
    out = []
    for t in range(xseq.shape[0]):
        acc = bias.to(F64).clone() if bias is not None else torch.zeros(xs.shape[0], dtype=F64)
        for w in range(W):
            acc = acc + weight[:, w].to(F64) * xs[:, t + w]
        out.append(silu64(acc))
    out = torch.stack(out) if out else torch.zeros(0, xs.shape[0], dtype=F64)
    return out, xs


def ssm_seq64(h, x, dt, A, B, C, D):
    """h [H,P,N], x [L,H,P], dt [L,H] (processed), B/C [L,G,N] -> (y [L,H,P], states [L,H,P,N])."""
    H = x.shape[1]
    G = B.shape[1]
    h = h.to(F64).clone()
    ys, hs = [], []
    for t in range(x.shape[0]):
        for hd in range(H):
            g = hd // (H // G)
            decay = math.exp(float(dt[t, hd]) * float(A[hd]))
            h[hd] = decay * h[hd] + float(dt[t, hd]) * torch.outer(x[t, hd].to(F64), B[t, g].to(F64))
        y = torch.stack([h[hd] @ C[t, hd // (H // G)].to(F64) for hd in range(H)])
        ys.append(y + D.to(F64)[:, None] * x[t].to(F64))
        hs.append(h.clone())
    if not ys:
        return torch.zeros(0, *x.shape[1:], dtype=F64), torch.zeros(0, *h.shape, dtype=F64)
    return torch.stack(ys), torch.stack(hs)


def close(actual, expected, tol):
    """max |a - e| <= tol * (1 + max |e|)."""
    a, e = actual.to(F64), expected.to(F64)
    err = (a - e).abs().max().item() if a.numel() else 0.0
    scale = 1.0 + (e.abs().max().item() if e.numel() else 0.0)
    assert err <= tol * scale, f"max err {err:.3e} > {tol:.1e} * {scale:.3f}"


def qsl_of(lens, dtype=torch.int32):
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=dtype)


def tol_of(dtype):
    return 2e-2 if dtype == torch.bfloat16 else 1e-5


def ssm_params(H, G, N, P, gen, small_dt=False):
    dt_bias = torch.randn(H, generator=gen) - (6.0 if small_dt else 1.0)
    A = -torch.exp(torch.rand(H, generator=gen) * 2 - 1)
    D = torch.randn(H, generator=gen)
    return dt_bias, A, D


# ----------------------------------------------------------------------------- conv varlen

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("W,K", [(4, 0), (4, 3), (2, 1), (3, 8)])
def test_conv_varlen_vs_naive(dtype, seed, W, K):
    gen = torch.Generator().manual_seed(seed)
    Cd, S = 24, 10
    lens = [5, 1, 0, 2, 17, 1, 3][: 4 + seed]
    Bn = len(lens)
    T = sum(lens)
    x = torch.randn(T, Cd, generator=gen).to(dtype)
    weight = torch.randn(Cd, W, generator=gen).to(dtype)
    bias = torch.randn(Cd, generator=gen).to(dtype) if seed != 1 else None
    pool = torch.full((S, Cd, W - 1 + K), math.nan, dtype=dtype)
    slots = torch.randperm(S - 1, generator=gen)[:Bn] + 1
    slots[1] = NULL_SLOT                                     # a padded row
    pool[slots] = torch.randn(Bn, Cd, W - 1 + K, generator=gen).to(dtype)
    pool[NULL_SLOT] = math.nan
    has_init = torch.rand(Bn, generator=gen) < 0.5
    has_init[0] = True
    before = pool.clone()

    qsl = qsl_of(lens, torch.int32 if seed % 2 else torch.int64)
    out = causal_conv1d_varlen(x, weight, bias, pool, qsl, slots.to(torch.int32), has_init)
    assert out.dtype == dtype and out.shape == (T, Cd)

    starts = qsl.tolist()
    for b in range(Bn):
        s0, s1 = starts[b], starts[b + 1]
        if slots[b] == NULL_SLOT:
            continue
        win = before[slots[b], :, : W - 1] if has_init[b] else torch.zeros(Cd, W - 1)
        ref, xs = conv_seq64(win, x[s0:s1], weight, bias)
        close(out[s0:s1], ref, tol_of(dtype))
        torch.testing.assert_close(pool[slots[b], :, : W - 1].to(F64), xs[:, xs.shape[1] - (W - 1):],
                                   rtol=0, atol=0)
        # spec columns beyond W-1 untouched
        torch.testing.assert_close(pool[slots[b], :, W - 1:], before[slots[b], :, W - 1:],
                                   equal_nan=True, rtol=0, atol=0)
    used = set(slots.tolist())
    for s in range(S):                                      # unused and null slots untouched (NaN)
        if s not in used or s == NULL_SLOT:
            torch.testing.assert_close(pool[s], before[s], equal_nan=True, rtol=0, atol=0)


def test_conv_varlen_padding_tokens_ignored():
    """Tokens past query_start_loc[B] do not disturb real rows."""
    gen = torch.Generator().manual_seed(5)
    Cd, W = 8, 4
    x = torch.randn(9, Cd, generator=gen)
    x[7:] = math.nan
    weight, bias = torch.randn(Cd, W, generator=gen), torch.randn(Cd, generator=gen)
    pool = torch.randn(3, Cd, W - 1, generator=gen)
    ref_pool = pool.clone()
    qsl = torch.tensor([0, 3, 7])
    slots = torch.tensor([1, 2])
    has = torch.tensor([True, False])
    out = causal_conv1d_varlen(x, weight, bias, pool, qsl, slots, has)
    out_ref = causal_conv1d_varlen(x[:7].clone(), weight, bias, ref_pool, qsl, slots, has)
    torch.testing.assert_close(out[:7], out_ref)
    torch.testing.assert_close(pool, ref_pool)


# ----------------------------------------------------------------------------- conv update

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [0, 1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_conv_update_vs_naive(dtype, K, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    Cd, W, S, Nr = 16, 4, 9, 5
    for s in sorted({1, K + 1, max(1, K // 2 + 1)}):
        x = torch.randn(Nr, s, Cd, generator=gen).to(dtype)
        weight = torch.randn(Cd, W, generator=gen).to(dtype)
        bias = torch.randn(Cd, generator=gen).to(dtype)
        pool = torch.full((S, Cd, W - 1 + K), math.nan, dtype=dtype)
        slots = torch.randperm(S - 1, generator=gen)[:Nr] + 1
        slots[2] = NULL_SLOT
        pool[slots] = torch.randn(Nr, Cd, W - 1 + K, generator=gen).to(dtype)
        pool[NULL_SLOT] = math.nan
        acc = torch.randint(1, K + 2, (Nr,), generator=gen)
        before = pool.clone()
        out = causal_conv1d_update(x, weight, bias, pool, slots.to(torch.int32), acc.to(torch.int32))
        assert out.dtype == dtype and out.shape == (Nr, s, Cd)
        for r in range(Nr):
            if slots[r] == NULL_SLOT:
                continue
            off = int(acc[r]) - 1
            win = before[slots[r], :, off: off + W - 1]
            ref, xs = conv_seq64(win, x[r], weight, bias)
            close(out[r], ref, tol_of(dtype))
            nw = W - 2 + s
            torch.testing.assert_close(pool[slots[r], :, :nw].to(F64), xs[:, 1:], rtol=0, atol=0)
            torch.testing.assert_close(pool[slots[r], :, nw:], before[slots[r], :, nw:],
                                       equal_nan=True, rtol=0, atol=0)
        used = set(slots.tolist())
        for sl in range(S):
            if sl not in used or sl == NULL_SLOT:
                torch.testing.assert_close(pool[sl], before[sl], equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("a", [1, 2, 3])
def test_conv_lazy_shift_example(a):
    """W=4, K=2: after a verify step of 3 tokens with `a` accepted, the next step reading at offset
    a-1 equals a from-scratch conv over the accepted prefix."""
    gen = torch.Generator().manual_seed(7)
    Cd, W, K = 6, 4, 2
    weight, bias = torch.randn(Cd, W, generator=gen), torch.randn(Cd, generator=gen)
    hist = torch.randn(5, Cd, generator=gen)                 # prefilled tokens
    pool = torch.full((2, Cd, W - 1 + K), math.nan)
    slot = torch.tensor([1])
    causal_conv1d_varlen(hist, weight, bias, pool, torch.tensor([0, 5]), slot, torch.tensor([False]))
    v = torch.randn(1, 3, Cd, generator=gen)                 # bonus + 2 drafts
    causal_conv1d_update(v, weight, bias, pool, slot, torch.tensor([1]))
    torch.testing.assert_close(pool[1].T, torch.cat([hist[-2:], v[0]]))   # [h2, h3, x0, x1, x2]
    nxt = torch.randn(1, 1, Cd, generator=gen)
    out = causal_conv1d_update(nxt, weight, bias, pool, slot, torch.tensor([a]))
    seq = torch.cat([hist, v[0, :a], nxt[0]])
    ref, _ = conv_seq64(torch.zeros(Cd, W - 1), seq, weight, bias)
    close(out[0, 0], ref[-1], 1e-5)
    torch.testing.assert_close(pool[1, :, : W - 1].T, seq[-(W - 1):])


# ----------------------------------------------------------------------------- SSD scan

def run_ssd_case(lens, H, G, P, N, chunk, gen, dt_limit=(0.0, math.inf), small_dt=False,
                 idx_dtype=torch.int32, max_seqlen=None):
    T = sum(lens)
    x = torch.randn(T, H, P, generator=gen)
    dt_raw = torch.randn(T, H, generator=gen)
    dt_bias, A, D = ssm_params(H, G, N, P, gen, small_dt)
    B = torch.randn(T, G, N, generator=gen)
    C = torch.randn(T, G, N, generator=gen)
    init = torch.randn(len(lens), H, P, N, generator=gen)
    qsl = qsl_of(lens, idx_dtype)
    y, fin = ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, qsl, init, chunk, dt_limit,
                             max_seqlen=max_seqlen)
    assert y.dtype == torch.float32 and fin.dtype == torch.float32
    assert y.shape == (T, H, P) and fin.shape == init.shape
    dt = dt64(dt_raw, dt_bias, dt_limit)
    st = qsl.tolist()
    for b in range(len(lens)):
        yr, hs = ssm_seq64(init[b], x[st[b]:st[b + 1]], dt[st[b]:st[b + 1]], A,
                           B[st[b]:st[b + 1]], C[st[b]:st[b + 1]], D)
        close(y[st[b]:st[b + 1]], yr, 1e-5)
        close(fin[b], hs[-1] if lens[b] else init[b], 1e-5)
    # the package's own oracle agrees too
    yn, fn = ssd_scan_naive(x, dt_raw, dt_bias, A, B, C, D, qsl, init, chunk, dt_limit)
    close(y, yn, 1e-5)
    close(fin, fn, 1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("chunk", [4, 8])
def test_ssd_chunk_boundaries(seed, chunk):
    gen = torch.Generator().manual_seed(seed)
    lens = [chunk - 1, chunk, chunk + 1, 2 * chunk + 3, 1, 0, 3]
    lens = lens[seed:] + lens[:seed]                         # vary the order
    run_ssd_case(lens, H=4, G=2, P=3, N=5, chunk=chunk, gen=gen,
                 idx_dtype=torch.int64 if seed % 2 else torch.int32)


@pytest.mark.parametrize("G", [1, 4])
def test_ssd_groups_and_single_sequence(G):
    gen = torch.Generator().manual_seed(11)
    run_ssd_case([37], H=4, G=G, P=4, N=8, chunk=8, gen=gen)
    run_ssd_case([5], H=4, G=G, P=4, N=8, chunk=16, gen=gen)          # shorter than a chunk


def test_ssd_dt_limit_and_hint():
    gen = torch.Generator().manual_seed(12)
    run_ssd_case([9, 20, 2], H=3, G=1, P=2, N=4, chunk=8, gen=gen, dt_limit=(1e-3, 0.5),
                 small_dt=True)
    run_ssd_case([9, 20, 2], H=3, G=1, P=2, N=4, chunk=8, gen=gen, max_seqlen=20)
    run_ssd_case([3, 5], H=3, G=1, P=2, N=4, chunk=64, gen=gen, max_seqlen=5)


@pytest.mark.parametrize("hint", [None, 20])
def test_ssd_device_grid_bounds(monkeypatch, hint):
    """The device path sizes its chunk grid from T, B (and the hint), not from query_start_loc;
    force that path on CPU."""
    import functools
    import mamba_cache.ops.ssd as ssd_mod
    monkeypatch.setattr(ssd_mod, "_grid_size", functools.partial(ssd_mod._grid_size, exact=False))
    gen = torch.Generator().manual_seed(15)
    run_ssd_case([7, 0, 20, 1, 8, 9], H=4, G=2, P=3, N=4, chunk=8, gen=gen, max_seqlen=hint)


def test_ssd_long_chunk_exact():
    """A long chunk with strong decay: segment sums must not cancel."""
    gen = torch.Generator().manual_seed(13)
    run_ssd_case([130, 64], H=2, G=1, P=2, N=3, chunk=64, gen=gen)


def test_ssd_all_empty_and_padding_tokens():
    gen = torch.Generator().manual_seed(14)
    H, P, N = 2, 3, 4
    init = torch.randn(2, H, P, N, generator=gen)
    dt_bias, A, D = ssm_params(H, 1, N, P, gen)
    e = torch.zeros(0, H, P)
    y, fin = ssd_scan_varlen(e, torch.zeros(0, H), dt_bias, A, torch.zeros(0, 1, N),
                             torch.zeros(0, 1, N), D, torch.tensor([0, 0, 0]), init, 8)
    assert y.shape == (0, H, P)
    torch.testing.assert_close(fin, init)
    # trailing padding tokens (NaN) past query_start_loc[B] do not disturb real rows
    T = 12
    x = torch.randn(T, H, P, generator=gen)
    dt_raw = torch.randn(T, H, generator=gen)
    Bm, Cm = torch.randn(T, 1, N, generator=gen), torch.randn(T, 1, N, generator=gen)
    qsl = torch.tensor([0, 4, 9])
    y_ref, f_ref = ssd_scan_varlen(x[:9], dt_raw[:9], dt_bias, A, Bm[:9], Cm[:9], D, qsl, init, 4)
    x[9:], dt_raw[9:], Bm[9:] = math.nan, math.nan, math.nan
    y2, f2 = ssd_scan_varlen(x, dt_raw, dt_bias, A, Bm, Cm, D, qsl, init, 4)
    torch.testing.assert_close(y2[:9], y_ref)
    torch.testing.assert_close(f2, f_ref)


# ----------------------------------------------------------------------------- state update

@pytest.mark.parametrize("K", [0, 1, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_state_update_vs_naive(K, seed):
    gen = torch.Generator().manual_seed(200 + seed)
    H, G, P, N, S, Nr = 4, 2, 3, 5, 8, 5
    dtype = torch.bfloat16 if seed else torch.float32       # model-dtype inputs, f32 state
    dt_bias, A, D = ssm_params(H, G, N, P, gen)
    for s in sorted({1, K + 1, max(1, K // 2 + 1)}):
        x = torch.randn(Nr, s, H, P, generator=gen).to(dtype)
        dt_raw = torch.randn(Nr, s, H, generator=gen).to(dtype)
        B = torch.randn(Nr, s, G, N, generator=gen).to(dtype)
        C = torch.randn(Nr, s, G, N, generator=gen).to(dtype)
        pool = torch.full((S, 1 + K, H, P, N), math.nan)
        slots = torch.randperm(S - 1, generator=gen)[:Nr] + 1
        slots[3] = NULL_SLOT
        pool[slots] = torch.randn(Nr, 1 + K, H, P, N, generator=gen)
        pool[NULL_SLOT] = -7.0                               # finite: a NaN write would hide
        acc = torch.randint(1, K + 2, (Nr,), generator=gen)
        before = pool.clone()
        y = selective_state_update(pool, x, dt_raw, dt_bias, A, B, C, D,
                                   slots.to(torch.int32), acc, dt_limit=(0.0, math.inf))
        assert y.dtype == torch.float32 and y.shape == (Nr, s, H, P)
        for r in range(Nr):
            if slots[r] == NULL_SLOT:
                continue
            h0 = before[slots[r], int(acc[r]) - 1]
            yr, hs = ssm_seq64(h0, x[r], dt64(dt_raw[r], dt_bias), A, B[r], C[r], D)
            close(y[r], yr, 1e-5)
            close(pool[slots[r], :s], hs, 1e-5)
            torch.testing.assert_close(pool[slots[r], s:], before[slots[r], s:],
                                       equal_nan=True, rtol=0, atol=0)
        used = set(slots.tolist())
        for sl in range(S):
            if sl not in used or sl == NULL_SLOT:
                torch.testing.assert_close(pool[sl], before[sl], equal_nan=True, rtol=0, atol=0)


def test_state_update_dt_limit():
    gen = torch.Generator().manual_seed(300)
    H, G, P, N = 2, 1, 2, 3
    dt_bias, A, D = ssm_params(H, G, N, P, gen, small_dt=True)
    x = torch.randn(2, 2, H, P, generator=gen)
    dt_raw = torch.randn(2, 2, H, generator=gen)
    B, C = torch.randn(2, 2, G, N, generator=gen), torch.randn(2, 2, G, N, generator=gen)
    pool = torch.randn(3, 2, H, P, N, generator=gen)
    h0 = pool[1:3, 0].clone()
    lim = (1e-3, 0.3)
    y = selective_state_update(pool, x, dt_raw, dt_bias, A, B, C, D, torch.tensor([1, 2]),
                               torch.tensor([1, 1]), lim)
    for r in range(2):
        yr, hs = ssm_seq64(h0[r], x[r], dt64(dt_raw[r], dt_bias, lim), A, B[r], C[r], D)
        close(y[r], yr, 1e-5)
        close(pool[1 + r], hs, 1e-5)


# ----------------------------------------------------------------------------- gated rmsnorm

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [4, 16])
def test_gated_rmsnorm(dtype, group_size):
    gen = torch.Generator().manual_seed(group_size)
    T, I, eps = 7, 16, 1e-5
    y = (torch.randn(T, I, generator=gen) * 3).to(dtype)
    z = torch.randn(T, I, generator=gen).to(dtype)
    w = torch.randn(I, generator=gen).to(dtype)
    out = gated_rmsnorm(y, z, w, group_size, eps)
    assert out.dtype == dtype and out.shape == (T, I)
    ref = torch.empty(T, I, dtype=F64)
    for t in range(T):
        g = y[t].to(F64) * silu64(z[t].to(F64))
        for s in range(0, I, group_size):
            seg = g[s: s + group_size]
            ref[t, s: s + group_size] = seg / torch.sqrt((seg * seg).mean() + eps)
    close(out, w.to(F64) * ref, tol_of(dtype))


# ----------------------------------------------------------------------------- compositions

class Mixer:
    """conv + SSM of one tiny Mamba2 layer over a shared pool (the pieces the engine chains)."""

    def __init__(self, gen, K=0, H=4, G=2, P=3, N=4, W=4, S=4, chunk=8):
        self.H, self.G, self.P, self.N, self.W, self.K, self.chunk = H, G, P, N, W, K, chunk
        self.Cd = H * P + 2 * G * N
        self.weight = torch.randn(self.Cd, W, generator=gen) * 0.5
        self.bias = torch.randn(self.Cd, generator=gen) * 0.1
        self.dt_bias, self.A, self.D = ssm_params(H, G, N, P, gen)
        self.conv = torch.full((S, self.Cd, W - 1 + K), math.nan)
        self.ssm = torch.full((S, 1 + K, H, P, N), math.nan)
        self.conv[NULL_SLOT], self.ssm[NULL_SLOT] = -7.0, -7.0    # finite sentinel for null rows

    def split(self, xbc, dt_raw):
        HP, GN = self.H * self.P, self.G * self.N
        lead = xbc.shape[:-1]
        x = xbc[..., :HP].reshape(*lead, self.H, self.P)
        B = xbc[..., HP: HP + GN].reshape(*lead, self.G, self.N)
        C = xbc[..., HP + GN:].reshape(*lead, self.G, self.N)
        return x, dt_raw, B, C

    def prefill(self, xbc, dt_raw, lens, slots, has_init):
        qsl = qsl_of(lens)
        slots = torch.tensor(slots)
        has_init = torch.tensor(has_init)
        c = causal_conv1d_varlen(xbc, self.weight, self.bias, self.conv, qsl, slots, has_init)
        x, dt, B, C = self.split(c, dt_raw)
        init = torch.where(has_init[:, None, None, None], self.ssm[slots, 0], 0.0)
        y, fin = ssd_scan_varlen(x, dt, self.dt_bias, self.A, B, C, self.D, qsl, init, self.chunk)
        keep = (slots == NULL_SLOT)[:, None, None, None]           # callers skip null rows too
        self.ssm[slots, 0] = torch.where(keep, self.ssm[slots, 0], fin)
        return y

    def step(self, xbc, dt_raw, slots, acc):
        slots, acc = torch.tensor(slots), torch.tensor(acc)
        c = causal_conv1d_update(xbc, self.weight, self.bias, self.conv, slots, acc)
        x, dt, B, C = self.split(c, dt_raw)
        return selective_state_update(self.ssm, x, dt, self.dt_bias, self.A, B, C, self.D, slots, acc)


@pytest.mark.parametrize("split", [1, 2, 7, 8, 9, 13])
def test_prefill_in_two_chunks_equals_one(split):
    gen = torch.Generator().manual_seed(400 + split)
    m = Mixer(gen)
    L = 21
    xbc = torch.randn(L, m.Cd, generator=gen)
    dt_raw = torch.randn(L, m.H, generator=gen)
    y1 = m.prefill(xbc, dt_raw, [L], [1], [False])
    y2a = m.prefill(xbc[:split], dt_raw[:split], [split], [2], [False])
    y2b = m.prefill(xbc[split:], dt_raw[split:], [L - split], [2], [True])
    close(torch.cat([y2a, y2b]), y1, 1e-5)
    close(m.ssm[2, 0], m.ssm[1, 0], 1e-5)
    torch.testing.assert_close(m.conv[2, :, :3], m.conv[1, :, :3])


def test_prefill_two_chunks_batched_with_other_rows():
    """Second chunk of one request batched with a fresh request and a padded (null) row."""
    gen = torch.Generator().manual_seed(450)
    m = Mixer(gen)
    xa, da = torch.randn(19, m.Cd, generator=gen), torch.randn(19, m.H, generator=gen)
    xb, db = torch.randn(5, m.Cd, generator=gen), torch.randn(5, m.H, generator=gen)
    ya = m.prefill(xa, da, [19], [1], [False])
    yb = m.prefill(xb, db, [5], [2], [False])
    ref_conv, ref_ssm = m.conv[1:3].clone(), m.ssm[1:3].clone()
    m.conv[1:3], m.ssm[1:3] = math.nan, math.nan
    m.prefill(xa[:10], da[:10], [10], [1], [False])
    x2 = torch.cat([xa[10:], xb, torch.randn(2, m.Cd, generator=gen)])
    d2 = torch.cat([da[10:], db, torch.randn(2, m.H, generator=gen)])
    y2 = m.prefill(x2, d2, [9, 5, 2], [1, 2, NULL_SLOT], [True, False, False])
    close(y2[:9], ya[10:], 1e-5)
    close(y2[9:14], yb, 1e-5)
    close(m.ssm[1:3, 0], ref_ssm[:, 0], 1e-5)
    torch.testing.assert_close(m.conv[1:3, :, :3], ref_conv[:, :, :3])


@pytest.mark.parametrize("K", [0, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_decode_and_verify_equal_prefill(K, seed):
    """Prefill, then decode/verify steps with random accepted counts (rejected drafts are junk):
    outputs at accepted positions and the state at the accepted checkpoint equal one prefill of
    the accepted token stream.  Two requests batched with a padded row."""
    gen = torch.Generator().manual_seed(500 + seed)
    m = Mixer(gen, K=K, S=5)
    n_req, P0, steps = 2, [6, 3], 6
    total = [P0[r] + steps * (K + 1) for r in range(n_req)]
    real = [torch.randn(total[r], m.Cd, generator=gen) for r in range(n_req)]
    real_dt = [torch.randn(total[r], m.H, generator=gen) for r in range(n_req)]
    slots = [3, 1]
    m.prefill(torch.cat([real[r][: P0[r]] for r in range(n_req)]),
              torch.cat([real_dt[r][: P0[r]] for r in range(n_req)]), P0, slots, [False, False])
    pos = list(P0)
    acc = [1] * n_req
    got = [[] for _ in range(n_req)]
    s = K + 1
    for _ in range(steps):
        xs, ds = [], []
        new_acc = []
        for r in range(n_req):
            a = int(torch.randint(1, K + 2, (1,), generator=gen))
            junk_x = torch.randn(s - a, m.Cd, generator=gen)
            junk_d = torch.randn(s - a, m.H, generator=gen)
            xs.append(torch.cat([real[r][pos[r]: pos[r] + a], junk_x]))
            ds.append(torch.cat([real_dt[r][pos[r]: pos[r] + a], junk_d]))
            new_acc.append(a)
        xs.append(torch.randn(s, m.Cd, generator=gen))         # padded row
        ds.append(torch.randn(s, m.H, generator=gen))
        y = m.step(torch.stack(xs), torch.stack(ds), slots + [NULL_SLOT], acc + [1])
        for r in range(n_req):
            got[r].append(y[r, : new_acc[r]])
            pos[r] += new_acc[r]
        acc = new_acc
    for r in range(n_req):
        ref = Mixer.__new__(Mixer)
        ref.__dict__.update(m.__dict__)
        ref.conv, ref.ssm = torch.zeros(2, m.Cd, m.W - 1 + K), torch.zeros(2, 1 + K, m.H, m.P, m.N)
        y_full = ref.prefill(real[r][: pos[r]], real_dt[r][: pos[r]], [pos[r]], [1], [False])
        close(torch.cat(got[r]), y_full[P0[r]:], 1e-5)
        a = acc[r]
        close(m.ssm[slots[r], a - 1], ref.ssm[1, 0], 1e-5)
        torch.testing.assert_close(m.conv[slots[r], :, a - 1: a - 1 + m.W - 1], ref.conv[1, :, : m.W - 1])
    assert (m.ssm[NULL_SLOT] == -7.0).all() and (m.conv[NULL_SLOT] == -7.0).all()
    assert m.ssm[[2, 4]].isnan().all() and m.conv[[2, 4]].isnan().all()   # unused slots


def test_ops_on_tiny_model_sizes_are_fast():
    """Engine-sized prefill (T ~ 300, I = 512) stays cheap on CPU."""
    import time
    gen = torch.Generator().manual_seed(600)
    H, G, P, N, T = 16, 2, 32, 64, 300
    lens = [120, 1, 60, 119]
    t0 = time.perf_counter()
    x = torch.randn(T, H, P, generator=gen)
    dt_raw = torch.randn(T, H, generator=gen)
    dt_bias, A, D = ssm_params(H, G, N, P, gen)
    B, C = torch.randn(T, G, N, generator=gen), torch.randn(T, G, N, generator=gen)
    init = torch.zeros(len(lens), H, P, N)
    y, fin = ssd_scan_varlen(x, dt_raw, dt_bias, A, B, C, D, qsl_of(lens), init, 128)
    assert torch.isfinite(y).all() and torch.isfinite(fin).all()
    assert time.perf_counter() - t0 < 5.0
