"""Host cost of the primitive calls a decode step is made of (CUDA): what one torch op, one view,
one event or one Triton launch costs on this machine's CPU. The async idle gap is host time per
step minus GPU time per step, so these per-call costs say where a step's host time can go.

Each call is timed in a loop of ``--iters`` (median of 5 loops), with the GPU kept busy by nothing
but the calls themselves (the stream never fills up at these sizes).

    python benchmarks/host_calls.py --out $OUT
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import save_json  # noqa: E402


def per_call_us(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    loops = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        loops.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(loops)


def _enter_exit(ctx) -> None:
    with ctx:
        pass


def calls(n: int = 32):
    """name -> zero-arg callable, each one primitive of the decode step path."""
    from hybrid_engine.step.decode_prep import DecodeDest, PrevOutputs, prepare_decode
    from hybrid_engine.step.transfer import D2H, H2D
    from hybrid_engine.mamba_cache.ops.triton_common import device_ctx

    dev = torch.device("cuda")
    a = torch.zeros(n, dtype=torch.int64, device=dev)
    logits = torch.randn(n, 32000, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream(dev)
    ev = torch.cuda.Event()
    h2d, d2h = H2D(dev), D2H(dev)
    host = np.arange(3 * n, dtype=np.int64)
    width, R = 2, n
    e64 = lambda m: torch.zeros(m, dtype=torch.int64, device=dev)  # noqa: E731
    dest = DecodeDest(e64(R), e64(R), e64(R), torch.zeros(R, dtype=torch.int32, device=dev),
                      torch.zeros(R, 8, dtype=torch.int32, device=dev), e64(R), e64(R))
    prev = PrevOutputs(e64(n)[:, None], e64(n) + 1, e64(n) + 5, e64(n)[:, None][:, :0])
    staged = h2d.put_raw(host)
    start_out, next_out = e64(n), e64(n)
    x = torch.zeros(4, 4, device=dev)
    g = torch.cuda.CUDAGraph()
    y = torch.zeros(4, 4, device=dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y.add_(x)
    out = {
        "python call (empty fn)": lambda: None,
        "torch.empty(32, int64, cuda)": lambda: torch.empty(n, dtype=torch.int64, device=dev),
        "tensor slice t[:16]": lambda: a[:16],
        "tensor view t.view(-1)": lambda: a.view(-1),
        "t[:, None]": lambda: a[:, None],
        "t.data_ptr()": lambda: a.data_ptr(),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "with device_ctx(t)": lambda: _enter_exit(device_ctx(a)),
        "event.record()": lambda: ev.record(),
        "torch.cuda.Event(enable_timing=True)": lambda: torch.cuda.Event(enable_timing=True),
        "stream.wait_event(ev)": lambda: side.wait_event(ev),
        "torch.cuda.set_stream(main)": lambda: torch.cuda.set_stream(torch.cuda.current_stream()),
        "logits.argmax(-1) [32, 32000] bf16": lambda: logits.argmax(-1),
        "a.add_(1)": lambda: a.add_(1),
        "H2D.begin_step + put_raw(96 words)": lambda: (h2d.begin_step(), h2d.put_raw(host)),
        "D2H.copy([32] int64)": lambda: d2h.copy(a),
        "D2H.copy + wait": lambda: d2h.copy(a).wait(),
        "prepare_decode (K=0, 32 rows)": lambda: prepare_decode(
            staged, n, width, prev, dest, block_size=16, num_spec=0, start_out=start_out, drafts_out=None,
            next_start_out=next_out),
        "graph.replay() (1 tiny kernel)": lambda: g.replay(),
        "with torch.inference_mode()": lambda: _enter_exit(torch.inference_mode()),
        "with torch.cuda.stream(side)": lambda: _enter_exit(torch.cuda.stream(side)),
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    rows = []
    with torch.inference_mode():
        for name, fn in calls().items():
            us = per_call_us(fn, args.iters)
            rows.append(dict(call=name, us=us))
            print(f"| {name} | {us:.2f} |", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        save_json(args.out / "host-calls.json", dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                     command=" ".join(sys.argv), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
