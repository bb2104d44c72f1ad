"""Cases for ``write_kv_triton`` (the CUDA KV-cache write) against the torch form of ``ops.write_kv``
(two ``index_copy_``, ``quantize_kv`` for FP8 caches): 16/32-bit caches with a dtype cast, FP8
caches with saturating, tiny and NaN values, head rows with a stride, padding tokens in the null
block, and poisoned caches whose untouched slots must keep their bytes.

Run as a script (``TRITON_INTERPRET=1``: the kernel on CPU) it prints one ``CASE name OK|FAIL`` line
per case; tests/engine/test_kv_write.py runs it, tests/gpu/test_fp8_kv_cuda.py imports ``check``.
"""
from __future__ import annotations

import sys

import torch

POISON_BYTE = 0x5A


def make_inputs(T, nkv, hd, dtype, *, strided=False, fp8=False, seed=0):
    """k, v [T, nkv, hd]; ``strided``: views of wider [T, nkv + 3, 2 hd] tensors (token and head
    strides both differ from the packed ones), v starting one head and 5 columns in."""
    g = torch.Generator().manual_seed(seed)
    width, cols = (nkv + 3, 2 * hd) if strided else (nkv, hd)
    k = torch.randn(T, width, cols, generator=g) * 3
    v = torch.randn(T, width, cols, generator=g) * 3
    h0, c0 = (1, 5) if strided else (0, 0)
    if fp8:            # saturating (also past float32: inf), tiny (below e4m3's subnormals after the
        # scale, -0 for a negative one) and NaN values
        k[0, 0, :7] = torch.tensor([1e4, -1e4, 3e-9, float("nan"), float("inf"), -float("inf"), -3e-9])
        v[-1, h0 + nkv - 1, c0 + hd - 3:c0 + hd] = torch.tensor([-5e3, 7e-9, 0.0])
    return k.to(dtype)[:, :nkv, :hd], v.to(dtype)[:, h0:h0 + nkv, c0:c0 + hd]


def check(impl, *, T, nkv, hd, dtype, cache_dtype, strided=False, pad=0, seed=0, device="cpu"):
    """impl(k, v, k_cache, v_cache, slots[, k_scale, v_scale]) into poisoned caches == the torch form.
    ``pad`` trailing tokens map into the null block 0 (their bytes there are unspecified)."""
    from hybrid_engine.attention.ops import write_kv
    fp8 = cache_dtype == torch.float8_e4m3fn
    k, v = make_inputs(T, nkv, hd, dtype, strided=strided, fp8=fp8, seed=seed)
    assert not strided or (k.stride(0) != nkv * hd and k.stride(1) != hd and v.stride(1) != hd)
    bs, N = 4, T // 2 + 4
    g = torch.Generator().manual_seed(seed + 1)
    slots = torch.randperm((N - 1) * bs, generator=g)[:T] + bs                 # outside the null block
    slots[T - pad:] = 0
    scales = (torch.tensor(0.0173), torch.tensor(0.61)) if fp8 else (None, None)
    nbytes = hd * torch.empty(0, dtype=cache_dtype).element_size()
    want_k = torch.full((N, bs, nkv, nbytes), POISON_BYTE, dtype=torch.uint8).view(cache_dtype)
    want_v = want_k.clone()
    write_kv(k, v, want_k, want_v, slots, *scales)                              # the torch form on CPU
    got_k = torch.full((N, bs, nkv, nbytes), POISON_BYTE, dtype=torch.uint8, device=device).view(cache_dtype)
    got_v = got_k.clone()
    impl(k.to(device), v.to(device), got_k, got_v, slots.to(device),
         *(None if s is None else s.to(device) for s in scales))
    for name, got, want in (("k", got_k, want_k), ("v", got_v, want_v)):
        got_b = got.cpu().view(torch.uint8).view(N * bs, -1)[bs:]              # the null block's rows aside
        want_b = want.view(torch.uint8).view(N * bs, -1)[bs:]
        if fp8:        # e4m3 has two NaN codes (the sign bit): both mean NaN (torch on CPU gives either)
            got_b, want_b = (torch.where(b == 0xFF, 0x7F, b).to(torch.uint8) for b in (got_b, want_b))
        assert torch.equal(got_b, want_b), f"{name}: {int((got_b != want_b).any(-1).sum())} slots differ"
    return f"{T} tokens"


F32, BF16, F16, E4M3 = torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn
CASES = {
    "f32_into_f32": dict(T=5, nkv=2, hd=16, dtype=F32, cache_dtype=F32),
    # (a bfloat16 cache holds bfloat16 k / v in the engine; the interpreter's float32 -> bfloat16
    # cast does not round to nearest even, so the cast case is float16)
    "bf16_into_bf16_strided": dict(T=7, nkv=3, hd=24, dtype=BF16, cache_dtype=BF16, strided=True),
    "bf16_into_bf16_padded": dict(T=9, nkv=2, hd=64, dtype=BF16, cache_dtype=BF16, pad=3),
    "f32_into_f16": dict(T=4, nkv=1, hd=8, dtype=F32, cache_dtype=F16),
    "bf16_into_fp8": dict(T=6, nkv=2, hd=32, dtype=BF16, cache_dtype=E4M3, pad=2),
    "f32_into_fp8_strided": dict(T=5, nkv=3, hd=20, dtype=F32, cache_dtype=E4M3, strided=True),
}


if __name__ == "__main__":
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpret import case_main
    from hybrid_engine.attention.triton_kv_write import write_kv_triton
    torch.set_num_threads(1)
    sys.exit(case_main(CASES, sys.argv[1:], run=lambda c: check(write_kv_triton, **c)))
