"""Multi-token selective state update for decode / speculative verify (CONTRACT item 4), and the
same followed by the grouped gated RMSNorm of its output (item 6, fused into one kernel on CUDA).

Pool tensor ``ssm_state [S, 1+K, H, P, N]`` float32, modified in place: checkpoint t holds the state
after query token t of the last verify step; the next step resumes from checkpoint num_accepted-1.
"""
from __future__ import annotations

import math

import torch

from hybrid_engine.mamba_cache import NULL_SLOT
from hybrid_engine.mamba_cache.ops.gated_norm import gated_rmsnorm_ref
from hybrid_engine.mamba_cache.ops.ssd import expand_groups, process_dt


def selective_state_update_ref(
    ssm_state: torch.Tensor,            # [S, 1+K, H, P, N] float32 pool, modified in place
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
) -> torch.Tensor:                      # y [N, s, H, P] out_dtype
    """h = ssm_state[slot, num_accepted-1] (loaded whole first); for t in 0..s-1:
    h = exp(dt_t A) h + dt_t x_t B_t^T ; ssm_state[slot, t] = h ; y_t = h C_t + D x_t.

    Loops over the s tokens (host int), vectorised over rows and heads; no host sync.
    """
    nrows, s, H, P = x.shape
    assert 1 <= s <= ssm_state.shape[1], "need 1 <= s <= 1+K"
    slots = state_indices.long()                                          # [N]
    src = (num_accepted.long() - 1).clamp(0, ssm_state.shape[1] - 1)      # [N]
    h = ssm_state[slots, src]                                             # [N, H, P, N] (a copy)
    old = ssm_state[slots, :s]                                            # [N, s, H, P, N] (copy)
    keep = (slots == NULL_SLOT)[:, None, None, None]

    dt = process_dt(dt_raw, dt_bias, dt_limit)                            # [N, s, H]
    dA = torch.exp(dt * A.float())                                        # [N, s, H]
    Bh = expand_groups(B.float(), H)                                      # [N, s, H, N]
    Ch = expand_groups(C.float(), H)                                      # [N, s, H, N]
    xf = x.float()                                                        # [N, s, H, P]
    ys = []
    for t in range(s):
        dBx = (dt[:, t, :, None] * xf[:, t])[..., None] * Bh[:, t, :, None, :]   # [N, H, P, N]
        h = dA[:, t, :, None, None] * h + dBx
        ssm_state[slots, t] = torch.where(keep, old[:, t], h)
        ys.append(torch.einsum("rhpn,rhn->rhp", h, Ch[:, t]) + D.float()[:, None] * xf[:, t])
    return torch.stack(ys, dim=1).to(out_dtype)                           # [N, s, H, P]


def selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices, num_accepted,
                           dt_limit=(0.0, math.inf), out_dtype=torch.float32):
    """Public entry point (CONTRACT item 4): Triton kernel on CUDA, torch reference elsewhere."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("selective_state_update", x.device) == "triton":
        from hybrid_engine.mamba_cache.ops.triton_state_update import triton_selective_state_update
        return triton_selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                             state_indices, num_accepted, dt_limit,
                                             out_dtype=out_dtype)
    return selective_state_update_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                      num_accepted, dt_limit, out_dtype)


def selective_state_update_gated_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                     num_accepted, z, norm_weight, group_size, eps,
                                     dt_limit=(0.0, math.inf)):
    """CONTRACT item 6: gated_rmsnorm_ref(y, z) of y = selective_state_update_ref(..., out_dtype=
    x.dtype), i.e. the unfused path's composition.  -> out [N, s, H*P] in x.dtype."""
    nrows, s, H, P = x.shape
    _check_gated(x, z, norm_weight, group_size)
    y = selective_state_update_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                   num_accepted, dt_limit, out_dtype=x.dtype)   # [N, s, H, P]
    out = gated_rmsnorm_ref(y.reshape(nrows * s, H * P), z.reshape(nrows * s, H * P), norm_weight,
                            group_size, eps)
    return out.view(nrows, s, H * P)


def selective_state_update_gated(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                 num_accepted, z, norm_weight, group_size, eps,
                                 dt_limit=(0.0, math.inf)):
    """Public entry point (CONTRACT item 6): the state update and the gated norm of its output in
    one Triton kernel on CUDA (two kernels if a norm group is not whole heads), the reference
    composition elsewhere.  z: [N*s, I] or [N, s, I], any strides; -> out [N, s, I] in x.dtype."""
    from hybrid_engine.mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("selective_state_update_gated", x.device) != "triton":
        return selective_state_update_gated_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                                state_indices, num_accepted, z, norm_weight,
                                                group_size, eps, dt_limit)
    nrows, s, H, P = x.shape
    _check_gated(x, z, norm_weight, group_size)
    if group_size % P:
        from hybrid_engine.mamba_cache.ops.triton_norm import triton_gated_rmsnorm
        from hybrid_engine.mamba_cache.ops.triton_state_update import triton_selective_state_update
        y = triton_selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                          state_indices, num_accepted, dt_limit,
                                          out_dtype=x.dtype)
        out = triton_gated_rmsnorm(y.view(nrows * s, H * P), z.reshape(nrows * s, H * P),
                                   norm_weight, group_size, eps)
        return out.view(nrows, s, H * P)
    from hybrid_engine.mamba_cache.ops.triton_state_update import triton_selective_state_update_gated
    return triton_selective_state_update_gated(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                               state_indices, num_accepted, z, norm_weight,
                                               group_size, eps, dt_limit)


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
