"""Rotary position embedding (RoPE) for the attention of the families that use it (Bamba,
Granite-4.0-H with ``position_embedding_type="rope"``, Falcon-H1; Nemotron-H has none).

Math (transformers' default rope type, "rotate half" layout): for the first ``rotary_dim`` dims of
each head, inv_freq[i] = theta ** (-2i / rotary_dim), angle = position * inv_freq (float32),
cos/sin of cat(angle, angle) rounded to the activations' dtype, and
x_rot' = x_rot * cos + rotate_half(x_rot) * sin with rotate_half(x) = cat(-x[d/2:], x[:d/2]);
the remaining dims pass through (partial rotary). Plain torch ops on every device: sync-free and
CUDA-graph safe (positions come from the step's ForwardBatch).
"""
from __future__ import annotations

import torch
from torch import nn


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """[rotary_dim // 2] float32 on the CPU (computed as transformers does, then moved)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, hd], k [T, Hk, hd], positions [T] int, inv_freq [rd/2] float32 -> rotated q, k."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]          # [T, rd/2]
    emb = torch.cat((freqs, freqs), dim=-1)                                  # [T, rd]
    cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
    rd = emb.shape[-1]

    def rot(x):
        xr = x[..., :rd]
        out = xr * cos + _rotate_half(xr) * sin
        return out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)
    return rot(q), rot(k)


class RotaryEmbedding(nn.Module):
    """Holds inv_freq (a float32 buffer outside the checkpoint, rebuilt by reset_runtime_state
    after the model is materialised from the meta device)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be an even integer >= 2, got {rotary_dim}")
        self.rotary_dim, self.theta = rotary_dim, float(theta)
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim, theta), persistent=False)

    def reset_runtime_state(self) -> None:
        self.inv_freq = rope_inv_freq(self.rotary_dim, self.theta).to(self.inv_freq.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        return apply_rope_ref(q, k, positions, self.inv_freq)
