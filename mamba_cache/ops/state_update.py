"""Multi-token selective state update for decode / speculative verify (CONTRACT item 4).

Pool tensor ``ssm_state [S, 1+K, H, P, N]`` float32, modified in place: checkpoint t holds the state
after query token t of the last verify step; the next step resumes from checkpoint num_accepted-1.
"""
from __future__ import annotations

import math

import torch

from mamba_cache import NULL_SLOT
from mamba_cache.ops.ssd import expand_groups, process_dt


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
    from mamba_cache.ops.triton_common import kernel_backend
    if kernel_backend("selective_state_update", x.device) == "triton":
        from mamba_cache.ops.triton_state_update import triton_selective_state_update
        return triton_selective_state_update(ssm_state, x, dt_raw, dt_bias, A, B, C, D,
                                             state_indices, num_accepted, dt_limit,
                                             out_dtype=out_dtype)
    return selective_state_update_ref(ssm_state, x, dt_raw, dt_bias, A, B, C, D, state_indices,
                                      num_accepted, dt_limit, out_dtype)
