"""The "ssu_gated" rows of benchmarks/kernels.py (a file of its own for kernels.py's line budget):
the state update with the gated norm fused in (one kernel) against the two kernels it replaces,
triton SSU (y in bf16) then triton gated norm, on the same inputs in the same run."""
from __future__ import annotations

import torch


def mk_ssu_gated(B, s, fused, ssu, norm):
    """-> (two-kernel calls, fused calls, bytes) like kernels.py's builders.  Bytes: the SSU's
    (checkpoint read, s checkpoint writes, x, dt, B, C, out) plus the z read; the fused kernel's
    y round trip through L2 and the weight are not counted."""
    from benchmarks import kernels as K       # imported here: kernels.py imports this module
    H, P, G, NST, I, DT = K.H, K.P, K.G, K.NST, K.I, K.DT
    K_ = s - 1
    ns = K.nsets_for(B * (1 + K_) * H * P * NST * 4)
    pool = torch.randn(B * ns + 1, 1 + K_, H, P, NST, device=K.DEV)
    dt_bias, A, D = K.rnd(H, dtype=torch.float32) - 2, -torch.rand(H, device=K.DEV) - 0.5, K.rnd(H)
    w = 1 + 0.1 * K.rnd(I)                                          # [I] bf16
    sets = []
    for k in range(ns):
        x, dt = K.rnd(B, s, H, P), K.rnd(B, s, H, scale=0.5)
        Bm, Cm = K.rnd(B, s, G, NST), K.rnd(B, s, G, NST)
        slots = torch.arange(1 + k * B, 1 + (k + 1) * B, device=K.DEV, dtype=torch.int32)
        acc = torch.randint(1, s + 1, (B,), device=K.DEV, dtype=torch.int32)
        z = K.rnd(B * s, I + K.CONV + H)[:, :I]      # [B*s, I]: a view of in_proj's output
        sets.append((x, dt, Bm, Cm, slots, acc, z))

    def two_kernels(p, x, dt, db, A_, Bm, Cm, D_, slots, acc, z, w_, gs, eps):
        y = ssu(p, x, dt, db, A_, Bm, Cm, D_, slots, acc, out_dtype=DT)     # [B, s, H, P]
        return norm(y.view(B * s, I), z, w_, gs, eps)

    def calls(fn):
        return [lambda a=a: fn(pool, a[0], a[1], dt_bias, A, a[2], a[3], D, a[4], a[5], a[6], w,
                               I // G, 1e-5) for a in sets]
    nbytes = B * (H * P * NST * 4 * (1 + s)                       # read 1 checkpoint, write s
                  + s * (H * P * 2 + H * 2 + 2 * G * NST * 2)      # x, dt, B, C (bf16)
                  + s * I * 2                                      # z (bf16)
                  + s * H * P * 2)                                 # out bf16
    return calls(two_kernels), calls(fused), nbytes
