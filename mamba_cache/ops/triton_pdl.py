"""Programmatic dependent launch (PDL) for the decode-path Triton kernels (Hopper and newer).

A decode step at batch 1 is hundreds of short kernels in a CUDA graph; between two dependent
kernels the GPU drains the first, then launches and ramps up the second. With PDL a kernel is
launched while its predecessor still runs: its programs become resident and wait in
``griddepcontrol.wait`` until the predecessor has completed and its writes are visible. On an
H100, a chain of expert-sized GEMVs in a CUDA graph ran 5-20% faster per kernel this way
(benchmarks/results/2026-11-26-pdl-h100.md).

The contract every kernel launched with PDL keeps (``pdl_enter`` as its first statement; the conv
update, ``triton_conv_update.py``, reads its weights first and then waits the same way):
- every program calls it, before any early exit and before any load of data another kernel
  writes and before any store; so a PDL kernel never reads early and never overwrites data its
  predecessor still reads;
- it returns an int32 zero that comes out of the wait's inline asm, and the kernel adds it to
  its program ids (and to the pointer of any input it reads at addresses that do not depend on a
  program id; times 16 for a pointer, which keeps its alignment). Every dependent load and store
  is then addressed from the wait's result, so neither Triton's passes nor LLVM can schedule it
  before the wait, and the asm also clobbers memory; below that, ptxas sees a constant zero and
  the order rests on it keeping instructions after ``griddepcontrol.wait``. (Triton 3.6's own
  ``gdc_wait`` is an asm with neither guard.)
- it also signals its own dependents at once (``griddepcontrol.launch_dependents``): they may
  become resident but wait the same way, so the chain stays ordered: a kernel that completed
  had waited for its predecessor, which had waited for its own.
Kernels launched without PDL (torch ops, NCCL) are ordered by the stream as always.

What breaking the contract costs, seen on an H100: with one kernel (the RMSNorm) launched with PDL
but without the wait, every batch-1 decode step of the 8B shape read stale activations and gave
non-finite logits. ``tests/engine/test_pdl_contract.py`` checks the contract on the source and
``tests/gpu/test_pdl_cuda.py`` checks that PDL on and off give the same tokens.

``pdl_kwargs(device)`` gives a launch's keyword arguments: ``PDL=True, launch_pdl=True`` on CUDA
compute capability >= 9 with a Triton that has the GDC intrinsics, else ``PDL=False`` (the kernel
then compiles without them; Triton's interpreter runs it as plain Python).
``HYBRID_ENGINE_PDL=0`` turns it off (A/B runs). The choice is logged once per device.

**Weight prefetch before the wait.** A weight-streaming kernel spends its first microseconds
waiting for DRAM while the GPU's bandwidth idles between two kernels. Such a kernel may take
``pdl_kwargs(device, prefetch=True)`` and start with ``if PREFETCH: w_first = first_weight_tile(...)``:
before ``pdl_enter`` it issues the load of the first weight tile its program streams (into
registers, waited for at its first use after the wait), so those bytes arrive while the previous
kernel drains. Safe because no step kernel writes a weight (weights are written once, at load);
routed experts could not do it (their rows depend on routing ids an earlier kernel writes). Only
the FP8 one-row projection does, where it measured a gain: H100, 8B FP8 batch-1 decode 295.7 ->
298.7 and 296.2 -> 298.8 tok/s. The bf16 one-row projection lost 1.5% with it, the Nano MoE
step (router and shared-expert GEMVs too) did not move, and an L2 prefetch
(``prefetch.global.L2`` per line) instead of registers made FP8 slower (3.38 -> 3.55 ms a step):
benchmarks/results/2026-11-27-weight-prefetch-h100.md. ``HYBRID_ENGINE_PREFETCH=0`` turns it off
(A/B runs).
"""
from __future__ import annotations

import functools
import os
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from .triton_common import logger

try:                                    # the launcher's launch_pdl option came with these (3.5)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    HAS_GDC = True
except ImportError:                     # an older Triton: PDL stays off
    HAS_GDC = False


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a PDL kernel: let the next kernel become resident, then wait until
    the previous one has completed. Returns an int32 zero to add to the program ids (module
    docstring); a plain 0 when PDL is False (no code)."""
    if PDL:
        return tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;\n\tmov.u32 $0, 0;",
            "=r,~{memory}", [], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return 0


@triton.jit
def first_weight_tile(w_ptr, stride_n, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Before ``pdl_enter`` (module docstring): the first [BLOCK_N, BLOCK_K] tile that program_id(0)
    streams from a weight [N, K] (row stride ``stride_n`` elements; zeros past N / K), loaded into
    registers. The load is issued here and waited for at its first use, after the grid-dependency
    wait: its DRAM latency overlaps the previous kernel's end. The caller multiplies it as its
    K loop's first iteration and starts the loop at BLOCK_K. The weight must not be written by a
    PDL kernel launched just before (none writes one); a torch op that wrote it has completed,
    since a kernel without PDL lets its successor start only when it ends."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_n + offs_k[None, :],
                   mask=(offs_n < N)[:, None] & (offs_k < K)[None, :], other=0.0)


_OFF = MappingProxyType({"PDL": False})            # read-only: every launch shares them
_ON = MappingProxyType({"PDL": True, "launch_pdl": True})
_ON_PREFETCH = MappingProxyType({"PDL": True, "launch_pdl": True, "PREFETCH": True})
_by_device: dict[int, MappingProxyType] = {}


def _decide(index: int) -> tuple[bool, str]:
    if os.environ.get("HYBRID_ENGINE_PDL", "1").strip() == "0":
        return False, "HYBRID_ENGINE_PDL=0"
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False, "Triton interpreter"
    if not HAS_GDC:
        return False, f"Triton {triton.__version__} has no grid dependency control"
    major, minor = torch.cuda.get_device_capability(index)
    if major < 9:
        return False, f"compute capability {major}.{minor} < 9.0"
    return True, f"compute capability {major}.{minor}"


def pdl_kwargs(device: torch.device, prefetch: bool = False) -> MappingProxyType:
    """Launch keyword arguments for a PDL-ready kernel on ``device`` (module docstring).
    ``prefetch``: the kernel has a ``PREFETCH`` flag (``first_weight_tile`` before its wait); it
    is set where PDL is on and ``HYBRID_ENGINE_PREFETCH`` is not 0. Cached per device: one dict
    lookup on the step path."""
    if device.type != "cuda":
        return _OFF
    index = device.index if device.index is not None else torch.cuda.current_device()
    kw = _by_device.get(index)
    if kw is None:
        on, why = _decide(index)
        kw = _by_device[index] = _ON if on else _OFF
        logger.info("programmatic dependent launch on cuda:%d: %s (%s)", index, "on" if on else "off", why)
    if prefetch and kw is _ON and _prefetch_enabled():
        return _ON_PREFETCH
    return kw


@functools.cache
def _prefetch_enabled() -> bool:
    """HYBRID_ENGINE_PREFETCH, read and logged once (until ``reset_pdl_choice``)."""
    on = os.environ.get("HYBRID_ENGINE_PREFETCH", "1").strip() != "0"
    logger.info("weight prefetch before the grid-dependency wait: %s", "on" if on else "off (HYBRID_ENGINE_PREFETCH=0)")
    return on


def reset_pdl_choice() -> None:
    """Forget the per-device choice and the prefetch switch (tests and A/B benchmarks that change
    HYBRID_ENGINE_PDL or HYBRID_ENGINE_PREFETCH)."""
    _by_device.clear()
    _prefetch_enabled.cache_clear()
