"""Random cases for the paged-attention kernel against ``paged_attention_ref`` (16-bit and FP8 caches),
in the style of kernel_cases.py (whose helpers they use): imported by test_kernels.py,
test_fp8_kv_cuda.py and the interpreter cases (interpret_cases.py)."""
from __future__ import annotations

import math

import torch

from hybrid_engine.attention.ops import paged_attention_ref
from kernel_cases import TOL, _gen, _qsl, assert_close, poison_allocator
from poisoned import nan_filled

FP8 = torch.float8_e4m3fn


# the GPU attention cases (test_kernels.py; FP8 caches: test_fp8_kv_cuda.py)
ATTN_CASES = [
    dict(q_lens=[1] * 5, ctx_lens=[0, 15, 16, 17, 100]),                       # decode
    dict(q_lens=[4] * 6, ctx_lens=[0, 3, 12, 40, 77, 300], nH=32, nkv=8, hd=128),  # verify K=3
    dict(q_lens=[9, 9, 9], ctx_lens=[0, 7, 200], nH=32, nkv=8, hd=128),        # verify K=8
    dict(q_lens=[50, 0, 130, 1], ctx_lens=[0, 5, 30, 64], nH=8, nkv=8, hd=64),  # prefill chunks
    dict(q_lens=[33, 2], ctx_lens=[10, 0], nH=16, nkv=2, hd=80),                # g=8, hd 80
    dict(q_lens=[1000], ctx_lens=[24], nH=32, nkv=8, hd=128),                  # long prefill
    dict(q_lens=[1, 1, 1], ctx_lens=[5, 1000, 31], nH=4, nkv=4, hd=128, bs=32),
]


def check_attention(impl, device, dtype, q_lens, ctx_lens, nH=8, nkv=2, hd=64, bs=16, pad=3,
                    seed=0, tol=None, kv_scales=None):
    """Row b has q_lens[b] queries after ctx_lens[b] earlier tokens (seq_len = sum). ``kv_scales=(k, v)``:
    an FP8 cache of random e4m3 codes over the whole range (~1% at +-448), scales given to both sides."""
    g = _gen(seed)
    Bn = len(q_lens)
    seq = [q + c for q, c in zip(q_lens, ctx_lens)]
    nblk = [-(-n // bs) for n in seq]
    M = max(nblk + [1]) + 1
    NB = sum(nblk) + 4
    T = sum(q_lens) + pad
    q = torch.randn(T, nH, hd, generator=g).to(dtype)
    if kv_scales is None:
        kc = torch.randn(NB, bs, nkv, hd, generator=g).to(dtype)
        vc = torch.randn(NB, bs, nkv, hd, generator=g).to(dtype)
        extra = {}
    else:
        codes = lambda: (torch.randn(NB, bs, nkv, hd, generator=g) * 180).clamp(-448, 448).to(FP8)  # noqa: E731
        kc, vc = codes(), codes()
        extra = {"k_scale": torch.tensor(float(kv_scales[0])).to(device),
                 "v_scale": torch.tensor(float(kv_scales[1])).to(device)}
    kc[0] = math.nan                                           # the null block: never read
    vc[0] = math.nan
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    bt = torch.zeros(Bn, M, dtype=torch.int32)                 # unused columns -> null block
    for b in range(Bn):
        blocks = [perm.pop() for _ in range(nblk[b])]
        bt[b, :nblk[b]] = torch.tensor(blocks, dtype=torch.int32)
        if nblk[b] and seq[b] % bs:                            # unwritten tail of the last block
            kc[blocks[-1], seq[b] % bs:] = math.nan
            vc[blocks[-1], seq[b] % bs:] = math.nan
    qsl = _qsl(q_lens, torch.int32)
    sl = torch.tensor(seq, dtype=torch.int32)
    d = lambda t: t.to(device)                                  # noqa: E731
    q, kc, vc, qsl, sl, bt = map(d, (q, kc, vc, qsl, sl, bt))
    scale = hd ** -0.5
    mq, ms = max(q_lens + [0]), max(seq + [0])
    ref = paged_attention_ref(q, kc, vc, qsl, sl, bt, scale, mq, ms, **extra)
    poison_allocator(device)
    with nan_filled("empty_like"):   # an unwritten output element (e.g. padding) stays NaN and fails
        out = impl(q, kc, vc, qsl, sl, bt, scale, mq, ms, **extra)
    assert out.dtype == dtype and out.shape == q.shape
    tol = tol or TOL["attn" if kv_scales is None else "attn_fp8"][dtype]
    return {"out": assert_close(out, ref, tol, "paged_attention")}
