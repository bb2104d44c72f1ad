"""Multi-token selective state update for decode / speculative verify (CONTRACT item 4), and the
same followed by the grouped gated RMSNorm of its output (item 6, fused into one kernel on CUDA).

Checkpointed pool (``pending=None``): ``ssm_state [S, 1+K, H, P, N]`` float32, modified in place;
checkpoint t holds the state after query token t of the last verify step, and the next step
resumes from checkpoint num_accepted-1.

Deferred pool (``pending``: a ``PendingInputs``, CONTRACT item 4b): ``ssm_state [S, 1, H, P, N]``
holds the state after token 0 of the last verify (always accepted), and ``pending`` the inputs of
its other tokens. The next step first replays the num_accepted-1 pending tokens, so a verify
writes one state instead of 1+K (at the 8B shape, batch 32, K=3: the state stores were ~13 GB a
step, 2.6x the greedy step's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops.gated_norm import gated_rmsnorm_ref
from hybrid_engine.mamba_cache.ops.ssd import expand_groups, process_dt


def ssu_block_p(P: int, N: int) -> int:
    """head_dim rows per program of the state-update kernel (the Triton kernel's tile). It fixes
    how many copies of dt and B a deferred pool keeps per head (``pending_blocks``), so it
    depends on the shape alone. At d_state 128, 16 rows (was 32): twice the programs at few rows,
    the same outputs and checkpoints bit for bit, and each launch 1-10% shorter at 1 and 8 rows,
    s = 1 and 4, on the bench-large, Nano and 8B head counts (H100, 2026-11-28,
    results/2026-11-28-spec-step-glue-h100.md)."""
    from hybrid_engine.mamba_cache.ops.triton_common import next_pow2    # (imports Triton lazily)
    block_n = max(16, next_pow2(N))
    return min(next_pow2(P), max(1, (2048 if block_n == 128 else 4096) // block_n))


def pending_blocks(P: int, N: int) -> int:
    """Copies of a pending token's dt and B per head: one per program (head_dim block), so a
    program only ever reads and overwrites its own (no program reads what another overwrites)."""
    return -(-P // ssu_block_p(P, N))


@dataclass(frozen=True)
class PendingInputs:
    """One Mamba layer's deferred verify inputs, per pool slot: those of tokens 1..K of the last
    verify step (token 0's state is in ``ssm_state[slot, 0]``), in the model dtype, so a replay
    computes exactly what the verify did. Owned by ``MambaPool``; written and read by the state
    update alone. nb = ``pending_blocks(P, N)``."""
    x: torch.Tensor      # [S, K, H, P]
    dt: torch.Tensor     # [S, K, H, nb] dt before softplus, the same value in each of the nb copies
    B: torch.Tensor      # [S, K, H, nb, N] each head's group's B, the same in each of the nb copies


def _coeffs_by_slot(dt_raw_by_slot, dt_bias, A, dt_limit):
    """dt = clamp(softplus(dt_raw + dt_bias)) and dA = exp(dt A), both [S, H] float32, computed over
    the pool's slot space: CPU vector math can round an element differently by where it falls in
    the tensor (vector body or scalar tail), so each (slot, head) keeps one position whichever
    rows a step has, and a replay in a later step (other rows, another order) computes the
    verify's bits."""
    dt = process_dt(dt_raw_by_slot.contiguous(), dt_bias, dt_limit).contiguous()     # [S, H]
    return dt, torch.exp(dt * A.float())


def _advance(h, x, dt, dA, B):
    """One token of the recurrence, h = dA h + dt x B^T: h [R, H, P, N], x [R, H, P], dt and dA
    [R, H] (``_coeffs_by_slot``), B [R, H, N] float32. The verify's tokens and the replay both go
    here, so a replayed state is the checkpointed one bit for bit."""
    dBx = (dt[:, :, None] * x)[..., None] * B[:, :, None, :]              # [R, H, P, N]
    return dA[:, :, None, None] * h + dBx


def selective_state_update_ref(
    ssm_state: torch.Tensor,            # [S, 1+K, H, P, N] float32 pool (deferred: [S, 1, ...]), in place
    x: torch.Tensor,                    # [N, s, H, P]  (s = 1 + drafts <= 1+K)
    dt_raw: torch.Tensor,               # [N, s, H] before softplus
    dt_bias: torch.Tensor,              # [H]
    A: torch.Tensor,                    # [H] float32, already -exp(A_log)
    B: torch.Tensor,                    # [N, s, G, N]
    C: torch.Tensor,                    # [N, s, G, N]
    D: torch.Tensor,                    # [H]
    state_indices: torch.Tensor,        # [N] pool slots (NULL_SLOT rows: no state write)
    num_accepted: torch.Tensor,         # [N] accepted count of the previous step, >= 1
    dt_limit=(0.0, math.inf),
    out_dtype: torch.dtype = torch.float32,
    pending: PendingInputs | None = None,
) -> torch.Tensor:                      # y [N, s, H, P] out_dtype
    """Checkpointed: h = ssm_state[slot, num_accepted-1] (loaded whole first); for t in 0..s-1:
    h = exp(dt_t A) h + dt_t x_t B_t^T ; ssm_state[slot, t] = h ; y_t = h C_t + D x_t.
    Deferred (``pending``): h = ssm_state[slot, 0] advanced by pending tokens 0..num_accepted-2;
    the same loop, storing h to ssm_state[slot, 0] after token 0 and the inputs of tokens
    1..s-1 to pending[slot, 0..s-2].

    Loops over the s tokens (host int), vectorised over rows and heads; no host sync.
    """
    nrows, s, H, P = x.shape
    slots = state_indices.long()                                          # [N]
    keep = (slots == NULL_SLOT)[:, None, None, None]
    if pending is None:
        assert 1 <= s <= ssm_state.shape[1], "need 1 <= s <= 1+K"
        src = (num_accepted.long() - 1).clamp(0, ssm_state.shape[1] - 1)  # [N]
        h = ssm_state[slots, src]                                         # [N, H, P, N] (a copy)
        old = ssm_state[slots, :s]                                        # [N, s, H, P, N] (copy)
    else:
        check_pending(ssm_state, pending, x, dt_raw, B)
        h = _replay(ssm_state, pending, slots, num_accepted, s, dt_bias, A, dt_limit)
        old = ssm_state[slots, :1]                                        # [N, 1, H, P, N] (copy)

    Bh = expand_groups(B.float(), H)                                      # [N, s, H, N]
    Ch = expand_groups(C.float(), H)                                      # [N, s, H, N]
    xf = x.float()                                                        # [N, s, H, P]
    ys = []
    by_slot = dt_raw.new_zeros(ssm_state.shape[0], H)                     # [S, H]
    for t in range(s):
        by_slot[slots] = dt_raw[:, t]          # (null rows share slot 0: their y is unspecified)
        dt, dA = (c[slots] for c in _coeffs_by_slot(by_slot, dt_bias, A, dt_limit))   # [N, H]
        h = _advance(h, xf[:, t], dt, dA, Bh[:, t])
        if pending is None or t == 0:
            ssm_state[slots, t] = torch.where(keep, old[:, t], h)
        ys.append(torch.einsum("rhpn,rhn->rhp", h, Ch[:, t]) + D.float()[:, None] * xf[:, t])
    if pending is not None:
        _store_pending(pending, slots, x, dt_raw, B)
    return torch.stack(ys, dim=1).to(out_dtype)                           # [N, s, H, P]


def check_pending(ssm_state, pending: PendingInputs, x, dt_raw, B) -> None:
    """Clear errors before a deferred update touches the pool (shared by both paths)."""
    nrows, s, H, P = x.shape
    K = pending.x.shape[1]
    if ssm_state.shape[1] != 1:
        raise ValueError(f"a deferred pool keeps one state per slot; ssm_state has {ssm_state.shape[1]}")
    if not 1 <= s <= 1 + K:
        raise ValueError(f"{s} tokens per row; a deferred pool of K={K} takes 1..{1 + K}")
    nb = pending_blocks(P, B.shape[-1])
    if pending.x.shape[2:] != (H, P) or pending.dt.shape[2:] != (H, nb) or pending.B.shape[2:] != (H, nb, B.shape[-1]):
        raise ValueError(f"pending inputs {tuple(pending.x.shape)}, {tuple(pending.dt.shape)}, "
                         f"{tuple(pending.B.shape)} do not fit H={H}, P={P}, N={B.shape[-1]} (nb={nb})")
    for name, new in (("x", x), ("dt_raw", dt_raw), ("B", B)):
        if new.dtype != pending.x.dtype:
            raise TypeError(f"{name} is {new.dtype} but the deferred pool stores {pending.x.dtype}: "
                            f"a replay would not reproduce the verify")


def _replay(ssm_state, pending: PendingInputs, slots, num_accepted, s, dt_bias, A, dt_limit):
    """The deferred pool's state after the previous verify's accepted tokens: ssm_state[slot, 0]
    advanced by pending tokens 0..num_accepted-2 (none for NULL_SLOT rows). -> h [N, H, P, N]."""
    K = pending.x.shape[1]
    h = ssm_state[slots, 0]                                               # [N, H, P, N] (a copy)
    n_replay = (num_accepted.long() - 1).clamp(0, K)                      # [N]
    n_replay = torch.where(slots == NULL_SLOT, 0, n_replay)
    for j in range(K):                  # capacity, a host int: rows past their count keep h
        dt, dA = (c[slots] for c in _coeffs_by_slot(pending.dt[:, j, :, 0], dt_bias, A, dt_limit))
        nxt = _advance(h, pending.x[slots, j].float(), dt, dA, pending.B[slots, j, :, 0].float())
        h = torch.where((j < n_replay)[:, None, None, None], nxt, h)
    return h


def _store_pending(pending: PendingInputs, slots, x, dt_raw, B) -> None:
    """pending[slot, t-1] = the inputs of token t, for t in 1..s-1 (NULL_SLOT rows keep theirs)."""
    s, H, nb = x.shape[1], x.shape[2], pending.dt.shape[-1]
    if s == 1:
        return
    keep = slots == NULL_SLOT                                             # [N]
    Bh = expand_groups(B[:, 1:], H)                                       # [N, s-1, H, N]
    for dst, new in ((pending.x, x[:, 1:]),
                     (pending.dt, dt_raw[:, 1:, :, None].expand(-1, -1, -1, nb)),
                     (pending.B, Bh[:, :, :, None].expand(-1, -1, -1, nb, -1))):
        old = dst[slots, :s - 1]                                          # [N, s-1, ...] (a copy)
        mask = keep.view(-1, *([1] * (new.dim() - 1)))
        dst[slots, :s - 1] = torch.where(mask, old, new)


def selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices, num_accepted,
                           dt_limit=(0.0, math.inf), out_dtype=torch.float32, pending=None):
    """Public entry point (CONTRACT item 4; 4b with ``pending``): Triton kernel on CUDA, torch
    reference elsewhere."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("selective_state_update", x.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_state_update import triton_selective_state_update
        return triton_selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                             state_indices, num_accepted, dt_limit,
                                             out_dtype=out_dtype, pending=pending)
    return selective_state_update_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                      num_accepted, dt_limit, out_dtype, pending)


def selective_state_update_gated_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                     num_accepted, z, norm_weight, group_size, eps,
                                     dt_limit=(0.0, math.inf), pending=None):
    """CONTRACT item 6: gated_rmsnorm_ref(y, z) of y = selective_state_update_ref(..., out_dtype=
    x.dtype), i.e. the unfused path's composition.  -> out [N, s, H*P] in x.dtype."""
    nrows, s, H, P = x.shape
    _check_gated(x, z, norm_weight, group_size)
    y = selective_state_update_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                   num_accepted, dt_limit, out_dtype=x.dtype,
                                   pending=pending)                     # [N, s, H, P]
    out = gated_rmsnorm_ref(y.reshape(nrows * s, H * P), z.reshape(nrows * s, H * P), norm_weight,
                            group_size, eps)
    return out.view(nrows, s, H * P)


def selective_state_update_gated(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                 num_accepted, z, norm_weight, group_size, eps,
                                 dt_limit=(0.0, math.inf), pending=None):
    """Public entry point (CONTRACT item 6): the state update and the gated norm of its output in
    one Triton kernel on CUDA (two kernels if a norm group is not whole heads), the reference
    composition elsewhere.  z: [N*s, I] or [N, s, I], any strides; -> out [N, s, I] in x.dtype."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("selective_state_update_gated", x.device) != "triton":
        return selective_state_update_gated_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                                state_indices, num_accepted, z, norm_weight,
                                                group_size, eps, dt_limit, pending)
    nrows, s, H, P = x.shape
    _check_gated(x, z, norm_weight, group_size)
    # two kernels where a norm group is not whole heads, and for a deferred verify: the fused
    # norm's last-program tail, hidden under a checkpointed verify's 1+K state stores, is exposed
    # once a verify writes one state (8B shape, 32 rows, s = 4: fused 192 us, the two kernels
    # ~116; H200, 2026-11-28, session 46)
    if group_size % P or (pending is not None and s > 1):
        from hybrid_engine.mamba_cache.ops.triton_norm import triton_gated_rmsnorm
        from hybrid_engine.mamba_cache.ops.triton_state_update import triton_selective_state_update
        y = triton_selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                          state_indices, num_accepted, dt_limit,
                                          out_dtype=x.dtype, pending=pending)
        out = triton_gated_rmsnorm(y.view(nrows * s, H * P), z.reshape(nrows * s, H * P),
                                   norm_weight, group_size, eps)
        return out.view(nrows, s, H * P)
    from hybrid_engine.mamba_cache.ops.triton_state_update import triton_selective_state_update_gated
    return triton_selective_state_update_gated(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                               state_indices, num_accepted, z, norm_weight,
                                               group_size, eps, dt_limit, pending=pending)


def _check_gated(x, z, norm_weight, group_size) -> None:
    """Argument checks shared by both paths (clear errors before any kernel)."""
    nrows, s, H, P = x.shape
    I = H * P
    if not isinstance(group_size, int) or group_size <= 0 or I % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive divisor of H*P={I}")
    if tuple(z.shape) not in ((nrows * s, I), (nrows, s, I)):
        raise ValueError(f"z has shape {tuple(z.shape)}; expected {(nrows * s, I)} or "
                         f"{(nrows, s, I)}")
    if tuple(norm_weight.shape) != (I,):
        raise ValueError(f"norm_weight has shape {tuple(norm_weight.shape)}; expected {(I,)}")


def reserve_ssu_norm_counters(device, max_rows: int, n_groups: int) -> None:
    """Size the fused kernel's per-(row, norm group) counters for up to max_rows rows of n_groups
    norm groups on ``device``, eagerly (call before capturing CUDA graphs that launch the fused
    op at a larger row count than any eager call did); a no-op where the reference runs."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("selective_state_update_gated", torch.device(device)) == "triton":
        from hybrid_engine.mamba_cache.ops import triton_state_update
        triton_state_update.reserve_ssu_norm_counters(device, max_rows, n_groups)
