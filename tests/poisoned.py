"""``nan_filled``: a torch allocator (``torch.empty``, ``torch.empty_like``) patched inside a block so
that the float tensors it returns start as NaN (float8_e4m3fn: its NaN byte 0x7F). An output element
a kernel forgets to write then stays NaN and fails the comparison, on CPU too (where the CUDA
caching allocator's poisoning, ``kernel_cases.poison_allocator``, cannot reach). Shared by the
quantized-kernel checks (tests/quant/quant_checks.py) and the attention cases
(tests/gpu/attention_cases.py)."""
from __future__ import annotations

import contextlib
import math

import torch


@contextlib.contextmanager
def nan_filled(name: str = "empty"):
    real = getattr(torch, name)

    def allocate(*a, **k):
        t = real(*a, **k)
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)
        elif t.is_floating_point() and t.dtype.itemsize > 1:
            t.fill_(math.nan)
        return t
    setattr(torch, name, allocate)
    try:
        yield
    finally:
        setattr(torch, name, real)
