"""Host cost of one Triton launch through the JIT (binder, cache key, launch metadata) against the
compiled kernel's launcher called directly (``CompiledKernel.run``), and a torch op, on this GPU
(issue 19: eager prefill steps are host-bound).

    python benchmarks/triton_launch.py         # CUDA, ~10 s
"""
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def k16(a, b, c, d, n0, n1, n2, n3, s0, s1, s2, s3, f0, f1, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n0
    x = tl.load(a + offs, mask=m, other=0.0)
    if FLAG:
        x = x * f0 + f1
    tl.store(d + offs, x, mask=m)


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        ts.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)


a = torch.randn(4096, device="cuda"); b = torch.empty_like(a); c = torch.empty_like(a); d = torch.empty_like(a)
args = (a, b, c, d, 4096, 17, 33, 1, 64, 128, 3, 5, 1.5, 0.25)
jit = lambda: k16[(4,)](*args, BLOCK=1024, FLAG=True)
kern = k16[(4,)](*args, BLOCK=1024, FLAG=True)
print("triton", triton.__version__, "torch", torch.__version__, torch.cuda.get_device_name())
print(f"JIT launch (16 args): {per_call_us(jit):.1f} us")
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
    print(f"direct CompiledKernel.run: {per_call_us(direct):.1f} us")
except Exception as exc:
    print("direct launch failed:", type(exc).__name__, str(exc)[:300])
print(f"torch.add(out=): {per_call_us(lambda: torch.add(a, b, out=c)):.1f} us")
x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16); w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
print(f"F.linear 64x4096x4096: {per_call_us(lambda: torch.nn.functional.linear(x, w), n=500):.1f} us (may be GPU-bound)")
