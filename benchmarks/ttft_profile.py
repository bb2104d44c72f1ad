"""Where a cached-prefix TTFT goes on the 8B shape (issue 19): a 2048-token system prompt computed
once, then requests of system + 300 new tokens, max_tokens=1, prefix caching on, one at a time.
Per request: wall ms of each engine.step; for one more request a torch profiler trace: CUDA kernel
launches, GPU busy time, aten ops, the top host-side ops by self CPU time and the top kernels.

    python benchmarks/ttft_profile.py          # CUDA, ~30 s
"""
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import random_weights  # noqa: E402
from benchmarks.prefix_cache import make_model_dir  # noqa: E402
from hybrid_engine import LLM, SamplingParams  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

root = Path(tempfile.mkdtemp())
md = make_model_dir("8b", root)
with random_weights():
    llm = LLM(str(md), dtype="bfloat16", device="cuda", max_num_seqs=32, max_num_batched_tokens=8192,
              enable_prefix_caching=True, mamba_checkpoint_interval=64, mamba_checkpoint_bytes=12 << 30,
              kv_cache_memory_fraction=0.5)
eng = llm.engine
rng = np.random.default_rng(0)
V = eng.cfg.model.vocab_size
system = rng.integers(3, V, 2048).tolist()
sp = SamplingParams(max_tokens=1, ignore_eos=True)
llm.generate([[5] * 64], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def one(i, prof=None):
    user = rng.integers(3, V, 300).tolist()
    req = eng.make_request(system + user, sp, f"s{i}")
    eng.add_request(req)
    steps = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.has_work():
        ts = time.perf_counter()
        for r in eng.step():
            if r.finished:
                eng.forget(r)
        steps.append((time.perf_counter() - ts) * 1e3)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, steps, req


for i in range(4):
    wall, steps, req = one(i)
    print(f"req {i}: wall {wall:.1f} ms, steps {[round(s, 1) for s in steps]}, cached {req.num_cached_tokens}, "
          f"ttft {1e3 * (req.metrics.first_token_time - req.metrics.arrival_time):.1f} ms", flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    wall, steps, req = one(99)
print(f"profiled: wall {wall:.1f} ms, steps {[round(s, 1) for s in steps]}, cached {req.num_cached_tokens}")
ev = prof.events()
gpu = [e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA]
print(f"GPU kernels {len(gpu)}, GPU busy {sum(e.device_time_total for e in gpu) / 1e3:.2f} ms")
launches = [e for e in ev if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")]
print(f"launch API calls {len(launches)}: " + ", ".join(f"{n} {sum(1 for e in launches if e.name == n)}" for n in {e.name for e in launches}))
aten = [e for e in ev if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("aten::")]
print(f"aten ops (incl. nested) {len(aten)}")
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
gk = {}
for e in gpu:
    gk.setdefault(e.name[:50], [0, 0.0]); gk[e.name[:50]][0] += 1; gk[e.name[:50]][1] += e.device_time_total / 1e3
for n, (c, t) in sorted(gk.items(), key=lambda kv: -kv[1][1])[:20]:
    print(f"{t:8.2f} ms {c:5d}x {n}")
