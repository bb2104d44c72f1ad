"""Naive per-token float64 oracles and shared helpers for the mamba_cache.ops tests (CONTRACT.md)."""
import math

import torch

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
