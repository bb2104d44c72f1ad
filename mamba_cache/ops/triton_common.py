"""Backend selection for the Mamba ops (and the attention dispatcher), plus small Triton helpers.

``kernel_backend(op, tensor)`` says which implementation a public op uses for a tensor:
- CPU tensors (and anything not CUDA) -> ``"torch_ref"``;
- CUDA tensors -> ``"triton"``; if Triton cannot be imported it warns loudly (once per op) and
  falls back to ``"torch_ref"``; a Triton kernel that fails to compile or launch raises (nothing
  catches it);
- ``HYBRID_ENGINE_KERNELS=torch`` forces the torch references everywhere (debugging, A/B runs).
The choice is logged once per (op, device type, backend) on ``logging.getLogger("hybrid_engine")``.
This module imports Triton lazily: importing it costs nothing on CPU-only machines.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger("hybrid_engine")
_logged: set[tuple[str, str, str]] = set()
_triton_ok: bool | None = None


# ``input_precision`` of the tensor-core dots of float32 models' Triton kernels (the chunked SSD
# scan, paged attention at prefill and decode, the grouped expert GEMM): "tf32x3" splits each
# float32 operand into two TF32 parts and sums three tensor-core products, about float32's
# accuracy at tensor-core speed; "ieee" lowered those dots to FMAs, 10-20x slower than the 16-bit
# kernels. H200, bench-large
# float32 prefill of 256 / 2048 tokens: 7.74 / 33.9 ms -> 5.27 / 20.0 ms (with ``cb_pre``), the
# first token's top-20 log-probabilities within 2e-6 (results/2026-11-29-f32-prefill-tf32x3-h200.md).
# Decode-sized projections keep their FMA kernels (``skinny_linear``: bit-exact across row counts).
F32_DOT_PRECISION = "tf32x3"


def triton_available() -> bool:
    """True if ``import triton`` works (cached)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401
            _triton_ok = True
        except Exception as exc:  # ImportError, or a broken install
            logger.warning("Triton is not importable (%s: %s): CUDA tensors will use the SLOW "
                           "torch reference ops", type(exc).__name__, exc)
            _triton_ok = False
    return _triton_ok


@functools.cache                 # per process: the interpreter is chosen before Triton starts
def triton_interpreting() -> bool:
    """True when Triton kernels run in its interpreter (TRITON_INTERPRET=1: CPU tensors, numpy
    semantics), where inline PTX and some hardware conversions are not available."""
    try:
        import triton
        return bool(triton.knobs.runtime.interpret)
    except ImportError:              # no Triton: nothing runs in its interpreter
        return False
    except AttributeError:           # a Triton without knobs: its environment variable
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def kernel_backend(op: str, device: torch.device) -> str:
    """'triton' or 'torch_ref' for ``op`` on ``device``; logs the choice once."""
    forced = os.environ.get("HYBRID_ENGINE_KERNELS", "").strip().lower()
    if device.type != "cuda" or forced in ("torch", "torch_ref", "ref"):
        backend = "torch_ref"
    elif triton_available():
        backend = "triton"
    else:
        backend = "torch_ref"
        key = (op, device.type, "missing")
        if key not in _logged:
            _logged.add(key)
            logger.warning("%s on %s: Triton missing, using the torch reference (slow)", op,
                           device.type)
    key = (op, device.type, backend)
    if key not in _logged:
        _logged.add(key)
        logger.info("%s backend on %s: %s", op, device.type, backend)
    return backend


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def search_iters(nseq: int) -> int:
    """Unrolled steps of a kernel's binary search over ``nseq + 1`` sequence offsets. At least 12
    (enough for 2047 sequences; extra steps are masked no-ops): a constexpr that followed each
    step's sequence count would compile a new kernel variant in the middle of serving whenever a
    step had a new power-of-two count of sequences."""
    return max(12, int(nseq).bit_length() + 1)


_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached; 132, an H100's, for any other device:
    the interpreter's launches then choose as on an H100)."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids: plain integer arithmetic (``triton.cdiv`` is a constexpr
    function on newer Triton, ~1.5 us a call through its wrapper: several per launch on eager steps)."""
    return -(-a // b)


class device_ctx:
    """``with device_ctx(t):`` makes t's CUDA device current for a launch (no-op on CPU)."""

    def __init__(self, t: torch.Tensor):
        self._ctx = torch.cuda.device(t.device) if t.is_cuda else None

    def __enter__(self):
        if self._ctx is not None:
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            return self._ctx.__exit__(*exc)
        return False


def tl_helpers():
    """Build the @triton.jit helpers on first use (so importing this module needs no Triton)."""
    global _helpers, triton, tl
    if _helpers is None:
        import triton
        import triton.language as tl   # module globals: the jit functions below resolve tl here

        @triton.jit
        def softplus(v):
            # log(1 + exp(v)) like F.softplus (threshold 20); log1p via Goldberg's trick:
            # log1p(e) = log(u) * e / (u - 1) with u = 1 + e (exact where u rounds to 1 as well).
            e = tl.exp(tl.minimum(v, 20.0))
            u = 1.0 + e
            lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
            return tl.where(v > 20.0, v, lp)

        @triton.jit
        def silu(v):
            return v / (1.0 + tl.exp(-v))

        _helpers = (softplus, silu)
    return _helpers


_helpers = None
triton = tl = None


class FastLaunch:
    """Launch a ``@triton.jit`` kernel on the step path without ``JITFunction.run``'s per-call
    argument binding and specialisation (~100 us of Python per launch on a slow host CPU).

    The first launch for a set of constexprs goes through ``kernel[grid](...)``, which compiles
    and returns the ``CompiledKernel``; later launches call that handle directly. The kernel must
    list every int argument in ``do_not_specialize`` (a value compiled as 1 or as a multiple of 16
    must not be reused for others). Tensor arguments are specialised on 16-byte alignment, so the
    alignment pattern is part of the cache key. Any failure of the direct path (another Triton
    version's API) logs once and falls back to the normal launch, never silently."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = list(kernel.arg_names)
        # (constexprs + options in the call's keyword order, alignment) -> (handle, constexpr
        # values in argument order, {grid: the handle's runner for that grid})
        self._cache: dict[tuple, tuple] = {}
        self._broken = False

    def __call__(self, grid, *args, **kw):
        # the key costs a few us per launch: keyword order is the call site's (a site that
        # reorders only adds an entry), and alignment is tested on tensors only
        align = tuple([a.data_ptr() % 16 == 0 for a in args if isinstance(a, torch.Tensor)])
        key = (tuple(kw.items()), align)
        entry = None if self._broken else self._cache.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **kw)
            if compiled is None and not self._broken:   # Triton's interpreter returns no handle
                self._broken = True
                logger.info("%s: no compiled handle (Triton's interpreter?); using the normal launch path",
                            getattr(self.kernel, "__name__", self.kernel))
            if not self._broken:
                consts = [kw[n] for n in self.names[len(args):]]
                self._cache[key] = (compiled, consts, {})
            return
        compiled, consts, runners = entry
        try:
            run = runners.get(grid)
            if run is None:                  # the handle wants 3 grid dims
                run = runners[grid] = compiled[tuple(grid) + (1,) * (3 - len(grid))]
            run(*args, *consts)
        except Exception as exc:   # noqa: BLE001 - an API change must not break serving
            self._broken = True
            logger.warning("direct Triton launch of %s failed (%s: %s); using the normal launch path",
                           self.kernel.__name__ if hasattr(self.kernel, "__name__") else self.kernel,
                           type(exc).__name__, exc)
            self.kernel[grid](*args, **kw)
