"""What a chat step costs on the 8B shape (issue 19): a cached-prefix turn's prefill row beside a few
decoding requests, with and without MTP, each step timed alone (synchronous scheduling: a step's
wall time is its own host and GPU time).

Per --mtp K: a 2048-token system prompt computed once; --beside requests decode (long outputs);
then --turns times a request of system + --new tokens (max_tokens=1) arrives, and the step that
prefills it is timed, beside the decode steps around it. The last such step is profiled (torch
profiler: GPU busy time, kernel launches, the top host ops and kernels).

    python benchmarks/mixed_step_cost.py --mtp 0 2 --out $OUT      # H100, ~2 minutes
    python benchmarks/mixed_step_cost.py --device cpu --shape tiny --system-len 64 --new 20   # smoke test
"""
import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import random_weights, save_json  # noqa: E402
from benchmarks.prefix_cache import make_model_dir  # noqa: E402
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_step(eng) -> float:
    _sync()
    t = time.perf_counter()
    for r in eng.step():
        if r.finished and r.request_id.startswith("t"):
            eng.forget(r)
    _sync()
    return (time.perf_counter() - t) * 1e3


def run(k: int, args, model_dir) -> dict:
    spec = SpeculativeConfig("mtp", k) if k else None
    cpu = args.device == "cpu"
    with random_weights():
        llm = LLM(str(model_dir), dtype="float32" if cpu else "bfloat16", device=args.device, max_num_seqs=32,
                  max_num_batched_tokens=8192, enable_prefix_caching=True, async_scheduling=False,
                  speculative_config=spec, **({"num_kv_blocks": 2000} if cpu else {"kv_cache_memory_fraction": 0.5}))
    eng = llm.engine
    rng = np.random.default_rng(0)
    V = eng.cfg.model.vocab_size
    system = rng.integers(3, V, args.system_len).tolist()
    llm.generate([system + rng.integers(3, V, 10).tolist()], SamplingParams(max_tokens=2, ignore_eos=True),
                 use_tqdm=False)
    for i in range(args.beside):
        eng.add_request(eng.make_request(rng.integers(3, V, 64).tolist(),
                                         SamplingParams(max_tokens=4000, ignore_eos=True), f"bg{i}"))
    for _ in range(12):
        timed_step(eng)
    mixed, decode, kinds = [], [], []
    prof_out = {}
    for i in range(args.turns):
        req = eng.make_request(system + rng.integers(3, V, args.new).tolist(),
                               SamplingParams(max_tokens=1, ignore_eos=True), f"t{i}")
        eng.add_request(req)
        last = i == args.turns - 1
        if last:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                ms = timed_step(eng)
            ev = prof.key_averages()
            gpu_us = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
            kernels = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA)
            host = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CPU),
                          key=lambda e: -e.self_cpu_time_total)[:12]
            top_k = sorted((e for e in ev if e.device_type == torch.autograd.DeviceType.CUDA),
                           key=lambda e: -e.self_device_time_total)[:12]
            prof_out = dict(profiled_step_ms=ms, gpu_busy_ms=gpu_us / 1e3, kernels=kernels,
                            top_host_ops=[(e.key, round(e.self_cpu_time_total / 1e3, 3), e.count) for e in host],
                            top_kernels=[(e.key[:80], round(e.self_device_time_total / 1e3, 3), e.count)
                                         for e in top_k])
        else:
            ms = timed_step(eng)
            mixed.append(ms)
        kinds.append(req.num_cached_tokens)
        for _ in range(3):
            decode.append(timed_step(eng))
    out = dict(mtp=k, beside=args.beside, new_tokens=args.new, cached_tokens=kinds,
               mixed_step_ms_median=float(np.median(mixed)), mixed_step_ms=[round(x, 2) for x in mixed],
               decode_step_ms_median=float(np.median(decode)),
               mixed_graphs=sum(1 for key in (eng.prefill_graphs.graphs if eng.prefill_graphs else ())
                                if key.decode_rows), **prof_out)
    del llm, eng
    torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mtp", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--beside", type=int, default=3, help="requests decoding beside the new turn")
    ap.add_argument("--new", type=int, default=270, help="new tokens of each turn after the shared prompt")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=["8b", "tiny"], default="8b", help="tiny: a CPU smoke test")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model_dir = make_model_dir(args.shape, Path(tempfile.mkdtemp()))
    results = []
    for k in args.mtp:
        r = run(k, args, model_dir)
        results.append(r)
        print({key: v for key, v in r.items() if key not in ("top_host_ops", "top_kernels")}, flush=True)
        for name in ("top_host_ops", "top_kernels"):
            print(name)
            for row in r.get(name, ()):
                print("   ", row)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        save_json(args.out / f"mixed-step-cost-{args.shape}.json", dict(args={k: str(v) for k, v in vars(args).items()},
                                                             results=results))


if __name__ == "__main__":
    main()
