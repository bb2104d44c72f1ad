"""Counter-based random numbers: a pure function of (seed, position, step, stream, index).

No generator state exists anywhere, so a request draws the same numbers alone or in any batch, in
any row order, sync or async, and a discarded or replayed step needs no bookkeeping.

Construction (all in torch int64 with wrapping arithmetic, so CPU and CUDA give identical bits):

- ``_mix`` is the splitmix64 finalizer (xor-shift-multiply, Stafford's "variant 13"), a bijection
  of 64-bit words with full avalanche. torch's ``>>`` on int64 is arithmetic, so every right shift
  is followed by a mask that clears the sign-extended bits, which makes it a logical shift.
- The row key absorbs its inputs one at a time: ``k = mix(mix(mix(mix(seed ^ C) + position*G) +
  step*G) + stream*G)``. Each stage is a bijection of the previous key for a fixed input, so two
  different (seed, position, step, stream) tuples collide only by a 64-bit accident.
- Element ``i`` of a row is ``mix(k + (i + 1) * G)``: the splitmix64 sequence seeded with ``k``.
- The top 23 bits ``x`` become ``(x + 0.5) * 2**-23``: exact in float32, strictly inside (0, 1),
  min 2**-24, max 1 - 2**-24 (so ``log(u)`` and ``log(-log(u))`` are always finite).

Statistical quality assumption: splitmix64 outputs over a Weyl sequence pass BigCrush, and we take
the outputs of distinct row keys as independent. Two rows' sequences overlap only if their keys
differ by a small multiple of G, which for mixed keys has probability about n / 2**64 per pair of
rows. The 23-bit resolution bounds the error of any event's probability by about 2**-23, far below
what the engine's sampling could resolve.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """The int64 (two's complement) reading of a 64-bit pattern."""
    x &= _MASK64
    return x - (1 << 64) if x >= (1 << 63) else x


_GAMMA = _i64(0x9E3779B97F4A7C15)  # golden-ratio increment of splitmix64
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)
_SEED_XOR = _i64(0x6A09E667F3BCC908)  # keeps mix(0) away from the fixed point 0
_BITS = 23
_SCALE = 2.0 ** -_BITS


def to_int64_seed(seed: int) -> int:
    """Any Python int seed as an int64 value (wrapping modulo 2**64)."""
    return _i64(int(seed))


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _times_gamma(x, like: torch.Tensor) -> torch.Tensor | int:
    """x * G with int64 wrapping, for an int or a tensor x."""
    if isinstance(x, torch.Tensor):
        return x.to(device=like.device, dtype=torch.int64) * _GAMMA
    return _i64(int(x) * _GAMMA)


def row_keys(seed: torch.Tensor, position: torch.Tensor, step, stream) -> torch.Tensor:
    """One 64-bit key per row from (seed, position, step, stream); step/stream int or tensor [R]."""
    seed = seed.to(torch.int64)
    position = position.to(device=seed.device, dtype=torch.int64)
    k = _mix(seed ^ _SEED_XOR)
    k = _mix(k + position * _GAMMA)
    k = _mix(k + _times_gamma(step, seed))
    return _mix(k + _times_gamma(stream, seed))


def uniform(seed: torch.Tensor, position: torch.Tensor, step, stream, n: int) -> torch.Tensor:
    """[R, n] float32 uniforms strictly inside (0, 1).

    seed[R], position[R]: int64. step, stream: int or int64 tensor broadcastable to [R].
    Column i of row r depends only on (seed[r], position[r], step[r], stream[r], i).
    """
    k = row_keys(seed, position, step, stream)
    idx = torch.arange(1, n + 1, device=k.device, dtype=torch.int64) * _GAMMA
    z = _mix(k[:, None] + idx)
    x = _shr(z, 64 - _BITS).to(torch.float32)
    return (x + 0.5) * _SCALE


def gumbel(seed: torch.Tensor, position: torch.Tensor, step, stream, n: int) -> torch.Tensor:
    """[R, n] float32 standard Gumbel noise, -log(-log(u)) of ``uniform``; always finite."""
    u = uniform(seed, position, step, stream, n)
    return -torch.log(-torch.log(u))
