"""Host cost of one Triton launch through the JIT (binder, cache key, launch metadata) against the
compiled kernel's launcher called directly (``CompiledKernel.run``), and a torch op, on this GPU
(issue 19: eager prefill steps are host-bound).

    python benchmarks/triton_launch.py         # CUDA, ~10 s
"""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host_calls import per_call_us  # noqa: E402


@triton.jit
def k16(a, b, c, d, n0, n1, n2, n3, s0, s1, s2, s3, f0, f1, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n0
    x = tl.load(a + offs, mask=m, other=0.0)
    if FLAG:
        x = x * f0 + f1
    tl.store(d + offs, x, mask=m)


a = torch.randn(4096, device="cuda"); b = torch.empty_like(a); c = torch.empty_like(a); d = torch.empty_like(a)
args = (a, b, c, d, 4096, 17, 33, 1, 64, 128, 3, 5, 1.5, 0.25)
jit = lambda: k16[(4,)](*args, BLOCK=1024, FLAG=True)
kern = k16[(4,)](*args, BLOCK=1024, FLAG=True)
print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
print(f"JIT launch (16 args): {per_call_us(jit, 2000):.1f} us")
try:
    from triton.runtime import driver
    dev = driver.active.get_current_device()
    stream = driver.active.get_current_stream(dev)
    full = args + (1024, True)
    direct = lambda: kern.run(4, 1, 1, stream, kern.function, kern.packed_metadata, None, None, None, *full)
    d.zero_()
    direct()
    torch.cuda.synchronize()
    assert torch.allclose(d, a * 1.5 + 0.25), "the direct launch did not run the kernel"
    print(f"direct CompiledKernel.run: {per_call_us(direct, 2000):.1f} us")
except Exception as exc:
    print("direct launch failed:", type(exc).__name__, str(exc)[:300])
print(f"torch.add(out=): {per_call_us(lambda: torch.add(a, b, out=c), 2000):.1f} us")
x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16); w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
print(f"F.linear 64x4096x4096: {per_call_us(lambda: torch.nn.functional.linear(x, w), 500):.1f} us (may be GPU-bound)")
