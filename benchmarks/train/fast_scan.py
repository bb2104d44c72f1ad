"""A differentiable chunked SSD scan for training, built from batched matmuls.

Why: on a machine without mamba-ssm, transformers' Nemotron-H mixer runs its PyTorch chunked scan.
Some transformers releases (5.17, on our GPU machine) write its contractions as broadcast products
followed by ``sum``, materialising ``[batch, chunk, L, L, heads, state]`` tensors: on the ``bench``
preset that is ~13 GB per layer and ~15 k tokens/s of training on an H100. The same math written
as matmuls needs ``[batch, chunk, heads, L, L]`` at most.

``chunk_scan`` takes the arguments of transformers' ``mamba2_chunk_scan`` and computes the same
function (tests/train/test_fast_scan.py compares values and gradients with it);
``training_scan()`` puts it in place of that function inside the Nemotron-H modeling module for
the duration of a ``with`` block, so evaluation after training still runs transformers' own code.

Shapes: b batch, T tokens (padded to c chunks of L), h heads in g groups of q = h / g heads,
p head dim, n state size.
"""
from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.nn.functional as F

from hybrid_engine.mamba_cache.ops.ssd import segsum   # [..., L] -> [..., L, L] log decays, -inf above

logger = logging.getLogger("benchmarks.train")


def chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
               dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False, z=None,
               seq_idx=None, cu_seqlens=None, **_):
    """hidden_states [b, T, h, p], dt [b, T, h], A [h], B / C [b, T, g, n], D [h] ->
    y [b, T, h, p] float32 (and the final state [b, h, p, n] with ``return_final_states``).
    Computed in float32 under any autocast (matmuls follow the TF32 setting), as transformers'
    scan is: the recurrence's decays would lose too much in bf16."""
    if z is not None:
        raise ValueError("chunk_scan: a gate z is not supported (the Nemotron-H mixer passes z=None)")
    if seq_idx is not None or cu_seqlens is not None:
        raise ValueError("chunk_scan: packed sequences (seq_idx / cu_seqlens) are not supported; "
                         "train on one sequence per row")
    with torch.autocast(hidden_states.device.type, enabled=False):
        return _chunk_scan(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus,
                           dt_limit, return_final_states)


def _chunk_scan(hidden_states, dt, A, B, C, chunk_size, D, dt_bias, initial_states, dt_softplus, dt_limit,
                return_final_states):
    b, T, h, p = hidden_states.shape
    g, n = B.shape[-2:]
    q, L = h // g, chunk_size
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1]).float()
    x = hidden_states.float()
    pad = (-T) % L
    c = (T + pad) // L

    def chunks(t):                                        # [b, T, ...] -> [b, c, L, ...], zero padded
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, c, L, *t.shape[2:])

    xdt = chunks(x * dt[..., None]).permute(0, 1, 3, 2, 4)              # [b, c, h, L, p]
    a = chunks(A.float() * dt).permute(0, 1, 3, 2)                      # [b, c, h, L] log decay
    Bc = chunks(B.float()).permute(0, 1, 3, 2, 4)                       # [b, c, g, L, n]
    Cc = chunks(C.float()).permute(0, 1, 3, 2, 4)                       # [b, c, g, L, n]
    a_cum = torch.cumsum(a, dim=-1)                                     # [b, c, h, L]

    # inside a chunk: y_i = sum_{j <= i} (C_i . B_j) exp(a_{j+1..i}) dt_j x_j
    CB = Cc @ Bc.transpose(-1, -2)                                      # [b, c, g, L, L]
    W = (CB[:, :, :, None] * _in_chunk_decay(a_cum).reshape(b, c, g, q, L, L))    # [b, c, g, q, L, L]
    y = W.view(b, c, h, L, L) @ xdt                                     # [b, c, h, L, p]

    # the state each chunk leaves from a zero start: sum_j exp(a_{j+1..L}) dt_j x_j B_j^T
    to_end = torch.exp(a_cum[..., -1:] - a_cum)                         # [b, c, h, L]
    xw = (xdt * to_end[..., None]).transpose(-1, -2)                    # [b, c, h, p, L]
    S = (xw.view(b, c, g, q, p, L) @ Bc[:, :, :, None]).view(b, c, h, p, n)

    # across chunks: the state entering chunk k = sum_{m <= k} exp(decays of chunks m..k-1) S_m,
    # with S_0 the initial state
    S0 = (torch.zeros_like(S[:, :1]) if initial_states is None
          else initial_states[:, None].to(device=S.device, dtype=S.dtype))
    S_all = torch.cat([S0, S], dim=1)                                   # [b, c+1, h, p, n]
    across = torch.exp(segsum(F.pad(a_cum[..., -1].transpose(1, 2), (1, 0))))  # [b, h, c+1, c+1]
    entering = (across @ S_all.permute(0, 2, 1, 3, 4).reshape(b, h, c + 1, p * n))
    entering = entering.view(b, h, c + 1, p, n)
    states, final = entering[:, :, :-1], entering[:, :, -1]             # [b, h, c, p, n], [b, h, p, n]

    # add what the entering state contributes: exp(a_{1..i}) C_i . state
    st = states.view(b, g, q, c, p, n).permute(0, 3, 1, 2, 5, 4)        # [b, c, g, q, n, p]
    y_in = (Cc[:, :, :, None] @ st).view(b, c, h, L, p) * torch.exp(a_cum)[..., None]
    y = (y + y_in).permute(0, 1, 3, 2, 4).reshape(b, c * L, h, p)
    if D is not None:
        y = y + D.float()[:, None] * F.pad(x, (0, 0, 0, 0, 0, pad))
    y = y[:, :T]
    return (y, final) if return_final_states else y


def _in_chunk_decay(a_cum: torch.Tensor) -> torch.Tensor:
    """a_cum [..., L] (cumulative log decays of a chunk) -> [..., L, L] exp(a_{j+1..i}) for j <= i,
    0 above, as differences of the cumsum. ``segsum`` (masked cumsum, exact for long chunks) took
    ~16% of a bench-large training step on an H100 in its [..., L, L] cumsums, forward and backward
    (benchmarks/results/2026-11-27-train-copy-windows-420s-h100.md). In float32 each difference
    carries about 2 * |a_cum| * 6e-8 of rounding in the exponent, plus the cumsum's own: ~1.5e-5
    relative at a chunk total of -145 against float64, where segsum gave ~4e-6."""
    L = a_cum.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=a_cum.device).tril()
    return torch.exp((a_cum[..., :, None] - a_cum[..., None, :]).masked_fill(~causal, -math.inf))


_warned: list[bool] = []


@contextlib.contextmanager
def training_scan():
    """Inside the block, transformers' Nemotron-H mixers run ``chunk_scan`` for their chunked scan.
    A transformers release without the module-level ``mamba2_chunk_scan`` keeps its own scan (a
    warning, once)."""
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    saved = getattr(m, "mamba2_chunk_scan", None)
    if saved is None:
        if not _warned:
            _warned.append(True)
            logger.warning("this transformers has no modeling_nemotron_h.mamba2_chunk_scan: training runs "
                           "transformers' own Mamba2 scan (benchmarks/train/fast_scan.py is not used)")
        yield
        return
    m.mamba2_chunk_scan = chunk_scan
    try:
        yield
    finally:
        m.mamba2_chunk_scan = saved
