"""Prefix-cache restore in one Triton launch per tensor: ``dst[l, slots[m]][block] :=
src[l, rows[m]]`` for every layer l and restore m (``MambaCheckpoints.restore``: checkpoint rows
into pool slots, all Mamba layers at once). ``checkpoints.restore_rows_ref`` is its torch twin (an
index gather and an ``index_put``). The twin's ``index_put`` into the all-layer pool costs ~23 kernels
per restore on the 8B shape, because torch splits an op on a tensor past 2 GiB of byte offsets
into 32-bit-indexable pieces; this kernel uses 64-bit offsets (H100, 2026-11-27:
benchmarks/results/2026-11-27-prefill-graphs-h100.md)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache.ops.triton_common import cdiv, device_ctx


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["rows_ptr", "slots_ptr"])
def _restore_kernel(src_ptr, dst_ptr, rows_ptr, slots_ptr, M, A, Bc,
                    s_l, s_r, s_a, s_b, d_l, d_s, d_a, d_b, BLOCK: tl.constexpr):
    # program (l * M + m, block): elements [block * BLOCK, +BLOCK) of the [A, Bc] tile of restore m
    # in layer l (each side with its own strides: the pool's conv windows are channel-major); a
    # negative row is a padding entry (prefill graphs' padded restores): nothing read or written
    pid = tl.program_id(0).to(tl.int64)
    layer = pid // M
    m = pid % M
    row = tl.load(rows_ptr + m).to(tl.int64)
    slot = tl.load(slots_ptr + m).to(tl.int64)
    i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < tl.where(row >= 0, A * Bc, 0)       # a padding entry: no element
    a = i // Bc
    b = i % Bc
    v = tl.load(src_ptr + layer * s_l + row * s_r + a * s_a + b * s_b, mask=mask)
    tl.store(dst_ptr + layer * d_l + slot * d_s + a * d_a + b * d_b, v.to(dst_ptr.dtype.element_ty), mask=mask)


def triton_restore_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """``dst[:, slots[m]] = src[:, rows[m]]`` for each m with ``rows[m] >= 0`` (a negative row is a
    padding entry: its slot is left alone); src [L, R, *inner], dst [L, S, *inner] (same inner
    shape; dst may be a strided view such as the pool's conv window columns 0..W-2). rows, slots
    [M] int64 device tensors (no host read)."""
    if src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"restore src {tuple(src.shape)} and dst {tuple(dst.shape)} differ beyond dim 1")
    if rows.shape != slots.shape or rows.dim() != 1:
        raise ValueError(f"rows {tuple(rows.shape)} and slots {tuple(slots.shape)} must both be [M]")
    M = rows.numel()
    if M == 0:
        return
    a, bc = _tile_shape(src)
    n = a * bc
    BLOCK = 4096 if n >= 4096 else max(16, 1 << (n - 1).bit_length())
    with device_ctx(src):
        _restore_kernel[(src.shape[0] * M, cdiv(n, BLOCK))](
            src, dst, rows, slots, M, a, bc, src.stride(0), src.stride(1), *_tile_strides(src),
            dst.stride(0), dst.stride(1), *_tile_strides(dst), BLOCK=BLOCK, num_warps=4)


def _tile_shape(t: torch.Tensor) -> tuple[int, int]:
    """The inner block of a [L, n, *inner] tensor as a 2-D tile [prod(inner[:-1]), inner[-1]]."""
    a = 1
    for d in t.shape[2:-1]:
        a *= d
    return a, t.shape[-1]


def _tile_strides(t: torch.Tensor) -> tuple[int, int]:
    """(stride along the tile's rows, along its columns); ValueError unless the leading inner dims
    merge into one (each stride = the next one times the next size)."""
    inner, st = t.shape[2:], t.stride()[2:]
    if len(inner) < 2:
        raise ValueError(f"restore needs >= 2 inner dims, got shape {tuple(t.shape)}")
    if any(st[j] != st[j + 1] * inner[j + 1] for j in range(len(inner) - 2)):
        raise ValueError(f"restore cannot merge the leading inner dims of strides {t.stride()}")
    return st[-2], st[-1]
