"""Compositions: chunked prefill equals one prefill; decode/verify equals prefill (state and outputs)."""
import math

import pytest
import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops import (
    causal_conv1d_update,
    causal_conv1d_varlen,
    selective_state_update,
    ssd_scan_varlen,
)
from oracles import close, qsl_of, ssm_params


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
