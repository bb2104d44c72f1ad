"""Triton multi-token selective state update (decode / speculative verify), CONTRACT item 4.

One program per (row, head, block of head_dim): the float32 state tile [BLOCK_P, N] lives in
registers.  It is loaded whole from checkpoint num_accepted-1 of the row's slot (then a barrier),
and for each of the s tokens: dt = clamp(softplus(dt_raw + dt_bias)), h = exp(dt A) h + dt x B^T,
store h to checkpoint t, y_t = h C_t + D x_t.  Rows on NULL_SLOT start from a zero state and store
nothing (their y is unspecified, but finite for finite inputs).  Any input strides.
LOAD_AHEAD (``_load_ahead``: s > 1, except float32 inputs above 4 rows): each token's x, dt, B, C
load one iteration early, so their latency overlaps the previous token's work; same values and
sums, bitwise the plain loop's result.

DEFERRED (CONTRACT item 4b, a spec engine's pool): the slot holds one state, the one after token 0
of the last verify, and ``PendingInputs`` hold that verify's other tokens' x, dt_raw and B.  The
program first replays the row's num_accepted-1 pending tokens (``_advance``, the loop's own
update, so the state is the checkpointed one bit for bit), then runs its s tokens, storing the
state after token 0 and the inputs of tokens 1..s-1.  A program reads and writes only its own
pending entries (dt and B have a copy per head_dim block), so programs never race; the barrier
after the replay orders its loads before the same program's stores.

FUSE_NORM (CONTRACT item 6): the gated RMSNorm (item 5) of y runs in the same launch.  Each program
stores its rounded y, then bumps a per-(row, norm group) counter; the program that arrives last in
its group (old value == programs per group - 1) resets the counter and normalises the whole group
in place, a few tokens at a time, with the standalone norm kernel's math.  The sum of squares is
done by that one program (no float atomics): deterministic, and the same math as the two-kernel
path.
Ordering: every thread's y stores -> CTA barrier -> counter RMW (acq_rel, gpu scope) in each
program; the last program's acquire RMW reads the value written by the previous release RMWs, so
all y stores of the group happen-before its (barrier, then .cg) loads.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops.state_update import check_pending, ssu_block_p
from hybrid_engine.mamba_cache.ops.triton_common import cdiv, device_ctx, next_pow2, tl_helpers
from hybrid_engine.mamba_cache.ops.triton_pdl import pdl_enter, pdl_kwargs

_softplus, _silu = tl_helpers()


@triton.jit
def _advance(h, x, dt_in, Bv, A, bias, dt_min, dt_max, CLAMP: tl.constexpr):
    """One token: dt = clamp(softplus(dt_raw + dt_bias)), h = exp(dt A) h + dt x B^T.  The token
    loop and the deferred replay both call it, so they compile the same arithmetic."""
    dt = _softplus(dt_in + bias)
    if CLAMP:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dA = tl.exp(dt * A)
    return h * dA + (x * dt)[:, None] * Bv[None, :]


@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "acc_ptr"])
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, dt_bias_ptr, A_ptr, B_ptr, C_ptr, D_ptr, slot_ptr, acc_ptr, y_ptr,
    s, H, P, N, nheads_per_group, max_ckpt, dt_min, dt_max,
    st_s, st_k, st_h, st_p, st_n,
    sx_r, sx_t, sx_h, sx_p,
    sdt_r, sdt_t, sdt_h,
    sb_r, sb_t, sb_g, sb_n,
    sc_r, sc_t, sc_g, sc_n,
    sy_r, sy_t, sy_h, sy_p,
    # FUSE_NORM only (None otherwise): z [N, s, I] strides, weight [I], counters [>= N * NG] int32
    z_ptr, w_ptr, cnt_ptr, sz_r, sz_t, sz_c, heads_per_ngroup, NG, gs, eps, progs_per_ngroup,
    # DEFERRED only (None otherwise): pending x [S, K, H, P], dt [S, K, H, nb], B [S, K, H, nb, N]
    px_ptr, pdt_ptr, pb_ptr, K_pend,
    spx_s, spx_k, spx_h, spx_p,
    spdt_s, spdt_k, spdt_h, spdt_b,
    spb_s, spb_k, spb_h, spb_b, spb_n,
    NULL: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    FUSE_NORM: tl.constexpr = False, BLOCK_G: tl.constexpr = 1, BLOCK_S: tl.constexpr = 1,
    PDL: tl.constexpr = False, LOAD_AHEAD: tl.constexpr = False, DEFERRED: tl.constexpr = False,
):
    z = pdl_enter(PDL)
    row = tl.program_id(0) + z
    head = tl.program_id(1) + z
    pb = tl.program_id(2) + z
    grp = head // nheads_per_group

    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp = offs_p < P
    mn = offs_n < N
    m2 = mp[:, None] & mn[None, :]

    slot = tl.load(slot_ptr + row).to(tl.int64)
    # full-shape mask (a scalar & block mask trips the interpreter)
    mst = m2 & ((tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.int64) + slot) != NULL)
    acc = tl.load(acc_ptr + row).to(tl.int64)
    src = tl.minimum(tl.maximum(acc - 1, 0), max_ckpt)      # deferred: max_ckpt 0

    tile = offs_p[:, None] * st_p + offs_n[None, :] * st_n            # [BLOCK_P, BLOCK_N]
    base = state_ptr + slot * st_s + head * st_h
    A = tl.load(A_ptr + head).to(tl.float32)
    Dh = tl.load(D_ptr + head).to(tl.float32)
    bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    x_base = x_ptr + row * sx_r + head * sx_h + offs_p * sx_p
    dt_base = dt_ptr + row * sdt_r + head * sdt_h
    b_base = B_ptr + row * sb_r + grp * sb_g + offs_n * sb_n
    c_base = C_ptr + row * sc_r + grp * sc_g + offs_n * sc_n
    y_base = y_ptr + row * sy_r + head * sy_h + offs_p * sy_p
    if LOAD_AHEAD:
        # token 0's inputs in flight together with the state tile
        x = tl.load(x_base, mask=mp, other=0.0).to(tl.float32)                      # [BLOCK_P]
        Bv = tl.load(b_base, mask=mn, other=0.0).to(tl.float32)                     # [BLOCK_N]
        Cv = tl.load(c_base, mask=mn, other=0.0).to(tl.float32)                     # [BLOCK_N]
        dt_in = tl.load(dt_base).to(tl.float32)
    h = tl.load(base + src * st_k + tile, mask=mst, other=0.0).to(tl.float32)
    if DEFERRED:
        live_p = mp & ((tl.zeros([BLOCK_P], dtype=tl.int64) + slot) != NULL)
        live_n = mn & ((tl.zeros([BLOCK_N], dtype=tl.int64) + slot) != NULL)
        px_base = px_ptr + slot * spx_s + head * spx_h + offs_p * spx_p
        pdt_base = pdt_ptr + slot * spdt_s + head * spdt_h + pb * spdt_b
        pb_base = pb_ptr + slot * spb_s + head * spb_h + pb * spb_b + offs_n * spb_n
        n_replay = tl.minimum(tl.maximum(acc - 1, 0), K_pend)
        n_replay = tl.where(slot == NULL, 0, n_replay)
        for j in range(0, n_replay):
            xr = tl.load(px_base + j * spx_k, mask=mp, other=0.0).to(tl.float32)
            dr = tl.load(pdt_base + j * spdt_k).to(tl.float32)
            br = tl.load(pb_base + j * spb_k, mask=mn, other=0.0).to(tl.float32)
            h = _advance(h, xr, dr, br, A, bias, dt_min, dt_max, CLAMP)
    # the whole source tile (and, deferred, every pending input) is in registers before any
    # checkpoint (pending entry) of this program is overwritten
    tl.debug_barrier()

    for t in range(0, s):
        if LOAD_AHEAD:
            # the next token's inputs load while this token's update, sum and stores run (the
            # compiler may not hoist a load above the stores: it cannot tell they do not alias)
            nt = tl.minimum(t + 1, s - 1)
            x_next = tl.load(x_base + nt * sx_t, mask=mp, other=0.0).to(tl.float32)
            B_next = tl.load(b_base + nt * sb_t, mask=mn, other=0.0).to(tl.float32)
            C_next = tl.load(c_base + nt * sc_t, mask=mn, other=0.0).to(tl.float32)
            dt_next = tl.load(dt_base + nt * sdt_t).to(tl.float32)
        else:
            x = tl.load(x_base + t * sx_t, mask=mp, other=0.0).to(tl.float32)
            Bv = tl.load(b_base + t * sb_t, mask=mn, other=0.0).to(tl.float32)
            Cv = tl.load(c_base + t * sc_t, mask=mn, other=0.0).to(tl.float32)
            dt_in = tl.load(dt_base + t * sdt_t).to(tl.float32)
        h = _advance(h, x, dt_in, Bv, A, bias, dt_min, dt_max, CLAMP)
        if DEFERRED:
            if t == 0:
                if FUSE_NORM:
                    if s > 1:                    # at s = 1: after the signal, below
                        tl.store(base + tile, h, mask=mst)
                else:
                    tl.store(base + tile, h, mask=mst)
            else:                                # the inputs a later replay needs
                tl.store(px_base + (t - 1) * spx_k, x.to(px_ptr.dtype.element_ty), mask=live_p)
                tl.store(pdt_base + (t - 1) * spdt_k, dt_in.to(pdt_ptr.dtype.element_ty),
                         mask=slot != NULL)
                tl.store(pb_base + (t - 1) * spb_k, Bv.to(pb_ptr.dtype.element_ty), mask=live_n)
        elif FUSE_NORM:
            if t < s - 1:                        # the last checkpoint: after the signal, below
                tl.store(base + t * st_k + tile, h, mask=mst)
        else:
            tl.store(base + t * st_k + tile, h, mask=mst)
        y = tl.sum(h * Cv[None, :], axis=1) + Dh * x
        tl.store(y_base + t * sy_t, y.to(y_ptr.dtype.element_ty), mask=mp)
        if LOAD_AHEAD:
            x, Bv, Cv, dt_in = x_next, B_next, C_next, dt_next

    if FUSE_NORM:
        ng = head // heads_per_ngroup
        cnt = cnt_ptr + row * NG + ng
        # all threads' y stores are ordered before the release (bar.sync, then a cumulative
        # gpu-scope release by the thread doing the scalar atomic)
        tl.debug_barrier()
        old = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
        # the release waits for every earlier store of the thread to complete; the last state
        # checkpoint (the bulk of them at s = 1) is stored after it, so it waits for y alone
        if DEFERRED:
            if s == 1:
                tl.store(base + tile, h, mask=mst)
        else:
            tl.store(base + (s - 1) * st_k + tile, h, mask=mst)
        if old == progs_per_ngroup - 1:          # uniform: the scalar result is CTA-broadcast
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")   # zero again for the next launch
            tl.debug_barrier()                   # the acquire (one thread) before every load
            r64 = row.to(tl.int64)
            offs_g = tl.arange(0, BLOCK_G)
            mg = offs_g < gs
            ch = ng * gs + offs_g                # [BLOCK_G] channels of the group
            w = tl.load(w_ptr + ch, mask=mg, other=0.0).to(tl.float32)
            # out is [N, s, H*P] contiguous (the wrapper allocates it): channel stride sy_p
            o_row = y_ptr + r64 * sy_r + ch[None, :] * sy_p                # [1, BLOCK_G]
            z_row = z_ptr + r64 * sz_r + ch[None, :] * sz_c
            # BLOCK_S tokens at a time: their loads are in flight together (this tail is on the
            # launch's critical path); each token is one row of the standalone kernel's block
            for t0 in range(0, s, BLOCK_S):
                offs_t = t0 + tl.arange(0, BLOCK_S)
                m2g = (offs_t < s)[:, None] & mg[None, :]                  # [BLOCK_S, BLOCK_G]
                # .cg: read L2, where the other programs' stores are; never a stale L1 line
                yv = tl.load(o_row + offs_t[:, None] * sy_t, mask=m2g, other=0.0,
                             cache_modifier=".cg").to(tl.float32)
                zv = tl.load(z_row + offs_t[:, None] * sz_t, mask=m2g, other=0.0).to(tl.float32)
                g = yv * _silu(zv)
                g = g * tl.rsqrt(tl.sum(g * g, axis=1) / gs + eps)[:, None]
                g = g.to(y_ptr.dtype.element_ty).to(tl.float32)
                g = (g * w[None, :]).to(y_ptr.dtype.element_ty)
                tl.store(o_row + offs_t[:, None] * sy_t, g, mask=m2g)


# (BLOCK_P, BLOCK_N, num_warps) per (head_dim, d_state); BLOCK_P is ssu_block_p (its measurement
# is there: a deferred pool's layout depends on it).
# A deferred verify (s > 1, unfused: the public op takes two kernels there) writes one state, so it
# is no longer bound by its stores but by each token's latency; 2 warps a program (more programs resident) beat 4 on the 8B shape at 32 rows,
# s = 4, random accepted counts: 113 us against 131 (H200, 2026-11-28, session 46). The y and
# states are bit for bit the 4-warp ones (the d_state reduction stays within a warp;
# test_deferred_state_update_is_bitwise_the_checkpointed compares across the two).
DEFERRED_VERIFY_WARPS = 2


def _config(P: int, N: int, rows_x_heads: int, deferred_verify: bool = False):
    return ssu_block_p(P, N), max(16, next_pow2(N)), DEFERRED_VERIFY_WARPS if deferred_verify else 4


# Over s > 1 tokens (a verify step) each iteration loads the next token's inputs before its own
# update and stores: 0.75-0.91x the time of a launch at one row and s = 4 on the bench-large (f32),
# Nano and 8B head counts, 0.94-0.97x at 8 bf16 rows (bitwise the same outputs and checkpoints);
# slower for float32 inputs at 8 rows (1.07-1.11x) and neutral at s = 1, which keep the plain loop
# (H100, 2026-11-28, results/2026-11-28-ssu-load-ahead-h100.md). Only 1 and 8 rows were measured:
# the float32 cut at 4 rows is a guess between them.
def _load_ahead(s: int, nrows: int, dtype: torch.dtype) -> bool:
    return s > 1 and (dtype != torch.float32 or nrows <= 4)


def triton_selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                  num_accepted, dt_limit=(0.0, math.inf), *,
                                  out_dtype=torch.float32, block_p=None, num_warps=None,
                                  pending=None):
    """Same arguments and result as ``selective_state_update_ref`` (y [N, s, H, P] out_dtype)."""
    nrows, s, H, P = x.shape
    y = torch.empty((nrows, s, H, P), dtype=out_dtype, device=x.device)
    _launch(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices, num_accepted, dt_limit, y,
            [None] * 11, dict(FUSE_NORM=False), block_p, num_warps, pending)
    return y


def triton_selective_state_update_gated(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                        num_accepted, z, norm_weight, group_size, eps,
                                        dt_limit=(0.0, math.inf), *, block_p=None,
                                        num_warps=None, block_s=None, pending=None):
    """Same arguments and result as ``selective_state_update_gated_ref`` (out [N, s, H*P] in
    x.dtype); the norm groups must be whole heads (group_size % P == 0).  block_s: tokens per
    step of the norm (default: up to 4096 elements per step, as the standalone kernel)."""
    nrows, s, H, P = x.shape
    I = H * P
    assert group_size % P == 0 and I % group_size == 0, (group_size, P, I)
    out = torch.empty((nrows, s, I), dtype=x.dtype, device=x.device)   # contiguous: see kernel
    z3 = z.unflatten(0, (nrows, s)) if z.dim() == 2 else z              # [N, s, I] view
    assert z3.shape == (nrows, s, I) and norm_weight.shape == (I,), (z.shape, norm_weight.shape)
    if nrows == 0:
        return out
    NG = I // group_size
    cnt = reserve_ssu_norm_counters(x.device, nrows, NG)
    BLOCK_P = block_p or _config(P, B.shape[-1], nrows * H)[0]
    fused = [z3, norm_weight, cnt, *z3.stride(), group_size // P, NG, group_size, float(eps),
             (group_size // P) * cdiv(P, BLOCK_P)]
    BLOCK_G = next_pow2(group_size)
    BLOCK_S = block_s or min(next_pow2(s), max(1, 4096 // BLOCK_G))
    _launch(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices, num_accepted, dt_limit,
            out.view(nrows, s, H, P), fused, dict(FUSE_NORM=True, BLOCK_G=BLOCK_G, BLOCK_S=BLOCK_S),
            BLOCK_P, num_warps, pending)
    return out


# Counters of the fused kernel: int32, one per (row, norm group), all zero between launches (each
# launch counts to programs-per-group and the last program resets its own).  One buffer per
# device, shared by every layer: launches that use it must be stream-ordered (one stream at a
# time).  It is never allocated during CUDA graph capture (the zero fill would only run at
# replay): size it eagerly first, with reserve_ssu_norm_counters or one eager call at the
# largest row count (the engine warms up each graph's batch eagerly before capturing it).
_counters: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []     # smaller buffers captured graphs may still use: kept alive


def reserve_ssu_norm_counters(device, max_rows: int, n_groups: int) -> torch.Tensor:
    """The device's counter buffer, grown (zeroed) to hold at least max_rows * n_groups."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _counters.get(device)
    need = max_rows * n_groups
    if buf is None or buf.numel() < need:
        if device.type == "cuda" and _capturing(device):
            raise RuntimeError(
                f"selective_state_update_gated needs {need} counters during CUDA graph capture "
                f"but {0 if buf is None else buf.numel()} are reserved: call "
                f"reserve_ssu_norm_counters(device, max_rows, n_groups) (or run one eager call "
                f"at the largest batch) before capturing")
        if buf is not None:
            _retired.append(buf)
        buf = _counters[device] = torch.zeros(max(need, 4096), dtype=torch.int32, device=device)
    return buf


def _capturing(device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


def _launch(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices, num_accepted, dt_limit, y,
            fused, consts, block_p, num_warps, pending):
    nrows, s, H, P = x.shape
    G, Nst = B.shape[-2:]
    assert ssm_state.dtype == torch.float32
    assert ssm_state.shape[2:] == (H, P, Nst)
    BLOCK_P, BLOCK_N, nw = _config(P, Nst, nrows * H,
                                   deferred_verify=pending is not None and s > 1 and not consts["FUSE_NORM"])
    if pending is None:
        assert 1 <= s <= ssm_state.shape[1], "need 1 <= s <= 1+K"
        deferred = [None] * 4 + [0] * 13
    else:
        check_pending(ssm_state, pending, x, dt_raw, B)
        if block_p not in (None, BLOCK_P):
            raise ValueError(f"a deferred pool's dt and B copies are laid out for block_p={BLOCK_P}")
        deferred = [pending.x, pending.dt, pending.B, pending.x.shape[1], *pending.x.stride(),
                    *pending.dt.stride(), *pending.B.stride()]
    if nrows == 0:
        return
    if block_p is not None:
        BLOCK_P = block_p
    if num_warps is not None:
        nw = num_warps
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    clamp = lo > 0.0 or hi < math.inf
    grid = (nrows, H, cdiv(P, BLOCK_P))
    with device_ctx(x):
        _ssu_kernel[grid](
            ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices, num_accepted, y,
            s, H, P, Nst, H // G, ssm_state.shape[1] - 1, lo if clamp else 0.0,
            hi if (clamp and hi < math.inf) else 3.0e38,
            *ssm_state.stride(), *x.stride(), *dt_raw.stride(), *B.stride(), *C.stride(),
            *y.stride(), *fused, *deferred,
            NULL=NULL_SLOT, CLAMP=clamp, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=nw,
            LOAD_AHEAD=_load_ahead(s, nrows, x.dtype), DEFERRED=pending is not None,
            **consts, **pdl_kwargs(x.device),
        )
