"""Paged attention ops: KV write, torch reference attention, backend dispatcher.

Shapes: T packed tokens, B rows, nH query heads, nkv kv heads, hd head dim, N cache blocks,
bs block size, M block-table width. No host synchronisation on device tensors in this file.
"""
from __future__ import annotations

import logging

import torch

from .kv_cache import FP8_KV_DTYPES, FP8_KV_MAX

logger = logging.getLogger("hybrid_engine")
_logged_backends: set[tuple[str, str, str]] = set()


def _log_once(op: str, device_type: str, choice: str, warn: bool = False) -> None:
    """Logs which path ``op`` takes on a device type, once per (op, device type, path)."""
    if (op, device_type, choice) not in _logged_backends:
        _logged_backends.add((op, device_type, choice))
        (logger.warning if warn else logger.info)("%s on %s: %s", op, device_type, choice)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 codes an FP8 KV cache stores for ``x``: x / scale in float32, clamped to the
    format's finite range (so large values saturate instead of becoming NaN), rounded to ``dtype``.
    ``scale``: [] float32 on x's device."""
    return (x.float() / scale).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(dtype)


def _check_scales(k_cache: torch.Tensor, k_scale, v_scale) -> None:
    """An FP8 cache comes with both scales and a 16/32-bit one with none (host metadata only):
    an FP8 cache read without its scales would silently use 1.0."""
    fp8 = k_cache.dtype in FP8_KV_DTYPES
    if fp8 != (k_scale is not None) or fp8 != (v_scale is not None):
        raise ValueError(f"a {k_cache.dtype} KV cache needs {'both' if fp8 else 'no'} k_scale / v_scale; got "
                         f"k_scale {'set' if k_scale is not None else 'None'}, "
                         f"v_scale {'set' if v_scale is not None else 'None'}")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v [T, nkv, hd]; caches [N, bs, nkv, hd]; slot_mapping [T] int64 = block * bs + offset.
    ``k_scale`` / ``v_scale`` ([] float32, FP8 caches only): the caches store ``quantize_kv``
    codes; None (16/32-bit caches): the values cast to the cache dtype.

    Padded tokens map into the null block 0 (duplicates there: last writer unspecified).
    CUDA: one Triton launch (``triton_kv_write``); elsewhere two ``index_copy_``.
    """
    _check_scales(k_cache, k_scale, v_scale)
    if _backend_for(k_cache.device) == "triton":
        from .triton_kv_write import write_kv_supported, write_kv_triton
        fast = write_kv_supported(k, v, k_cache, v_cache, slot_mapping)
        _log_once("write_kv", k_cache.device.type, "triton" if fast else
                  "torch index_copy_ (shapes, strides or caches outside the kernel's: write_kv_supported)",
                  warn=not fast)
        if fast:
            write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
            return
    nkv, hd = k_cache.shape[-2:]
    kc = k_cache.view(-1, nkv, hd)                    # [N*bs, nkv, hd], shares storage
    vc = v_cache.view(-1, nkv, hd)
    idx = slot_mapping.to(torch.long)
    if k_scale is None:
        kc.index_copy_(0, idx, k.to(kc.dtype))
        vc.index_copy_(0, idx, v.to(vc.dtype))
        return
    # index_copy_ has no float8 kernels: the codes move as bytes (same itemsize, same layout)
    kc.view(torch.uint8).index_copy_(0, idx, quantize_kv(k, k_scale, kc.dtype).view(torch.uint8))
    vc.view(torch.uint8).index_copy_(0, idx, quantize_kv(v, v_scale, vc.dtype).view(torch.uint8))


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                        block_tables: torch.Tensor, scale: float, max_query_len: int,
                        max_seq_len: int, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over a paged cache. Returns out [T, nH, hd] in q.dtype.

    q [T, nH, hd]; k_cache, v_cache [N, bs, nkv, hd]; query_start_loc [B+1] (non-decreasing);
    seq_lens [B]; block_tables [B, M]. Row b's query i sits at position seq_len - q_len + i.
    Tokens t >= query_start_loc[B] (graph padding) and rows with q_len 0 produce zeros.
    Block-table entries of columns past ceil(seq_len / bs) are never read (treated as block 0).
    FP8 caches: ``k_scale`` / ``v_scale`` ([] float32); K = code * k_scale, V = code * v_scale,
    dequantized exactly in float32.
    """
    T, nH, hd = q.shape
    N, bs, nkv, _ = k_cache.shape
    B, M = block_tables.shape
    g = nH // nkv
    dev = q.device
    cdt = torch.promote_types(q.dtype, torch.float32)        # float32 math (float64 stays float64)
    Mp = min(-(-max(int(max_seq_len), 0) // bs), M)           # table columns used (host int)
    Qm = max(int(max_query_len), 0)
    if T == 0 or B == 0 or Mp == 0 or Qm == 0:
        return torch.zeros_like(q)
    S = Mp * bs

    qsl = query_start_loc.to(device=dev, dtype=torch.long)   # [B+1]
    sl = seq_lens.to(device=dev, dtype=torch.long)           # [B]
    q_lens = qsl[1:] - qsl[:-1]                              # [B]

    # Gather K/V per row: [B, Mp] -> [B, S, nkv, hd]; unused columns read the null block.
    cols = torch.arange(Mp, device=dev)
    bt = block_tables[:, :Mp].to(device=dev, dtype=torch.long)
    bt = torch.where(cols[None, :] * bs < sl[:, None], bt, 0)           # [B, Mp]
    kpos = torch.arange(S, device=dev)                                  # [S]
    kvalid = (kpos[None, :] < sl[:, None])[:, :, None, None]            # [B, S, 1, 1]
    zero = torch.zeros((), dtype=cdt, device=dev)
    K = k_cache[bt].reshape(B, S, nkv, hd).to(cdt)
    V = v_cache[bt].reshape(B, S, nkv, hd).to(cdt)
    if k_scale is not None:                                             # FP8 codes -> values
        K, V = K * k_scale.to(cdt), V * v_scale.to(cdt)
    K = torch.where(kvalid, K, zero)                                    # garbage -> 0
    V = torch.where(kvalid, V, zero)

    # Packed -> padded queries by gather: Qp[b, j] = q[qsl[b] + j] for j < q_len[b].
    j = torch.arange(Qm, device=dev)                                    # [Qm]
    qvalid = j[None, :] < q_lens[:, None]                               # [B, Qm]
    qidx = (qsl[:-1, None] + j[None, :]).clamp(0, T - 1)                # [B, Qm]
    Qp = torch.where(qvalid[:, :, None, None], q[qidx].to(cdt), zero)   # [B, Qm, nH, hd]

    # Causal + length mask: key s visible to query j iff s <= seq_len - q_len + j.
    qpos = sl[:, None] - q_lens[:, None] + j[None, :]                   # [B, Qm]
    mask = (kpos[None, None, :] <= qpos[:, :, None]) & qvalid[:, :, None]   # [B, Qm, S]
    mask = mask[:, None, None]                                          # [B, 1, 1, Qm, S]

    Qg = Qp.view(B, Qm, nkv, g, hd)
    scores = torch.einsum("bqkgd,bskd->bkgqs", Qg, K) * scale           # [B, nkv, g, Qm, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~mask, 0.0)       # fully masked rows -> 0
    out_p = torch.einsum("bkgqs,bskd->bqkgd", probs, V).reshape(B * Qm, nH, hd)

    # Padded -> packed: token t belongs to row = #(qsl[1:] <= t), index i = t - qsl[row].
    t = torch.arange(T, device=dev)
    row = torch.searchsorted(qsl[1:].contiguous(), t, right=True)       # [T], B if past the end
    rowc = row.clamp(max=B - 1)
    i = t - qsl[rowc]
    tvalid = (row < B) & (t >= qsl[0]) & (i < Qm)
    flat = rowc * Qm + i.clamp(0, Qm - 1)                               # [T]
    out = torch.where(tvalid[:, None, None], out_p[flat], zero)
    return out.to(q.dtype)


def _backend_for(device: torch.device) -> str:
    """'triton' for CUDA tensors (torch_ref, with a loud warning, if Triton cannot be imported;
    HYBRID_ENGINE_KERNELS=torch forces the reference); 'torch_ref' elsewhere."""
    import os

    from hybrid_engine.mamba_cache.ops.triton_common import triton_available
    if os.environ.get("HYBRID_ENGINE_KERNELS", "").strip().lower() in ("torch", "torch_ref", "ref"):
        return "torch_ref"
    if device.type == "cuda" and triton_available():   # triton_available() warns once if not
        return "triton"
    return "torch_ref"


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, scale: float, max_query_len: int,
                    max_seq_len: int, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Dispatch to the best backend for q.device (same signature as paged_attention_ref)."""
    _check_scales(k_cache, k_scale, v_scale)
    backend = _backend_for(q.device)
    _log_once("paged_attention backend", q.device.type, backend)
    if backend == "triton":
        from .triton_attention import triton_paged_attention
        return triton_paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens,
                                      block_tables, scale, max_query_len, max_seq_len,
                                      k_scale=k_scale, v_scale=v_scale)
    return paged_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                               scale, max_query_len, max_seq_len, k_scale, v_scale)
