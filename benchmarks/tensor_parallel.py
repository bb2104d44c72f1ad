"""Tensor parallelism on CUDA: decode tokens/s at TP=1 and TP=2 on one host, the all-reduce time a
step spends, and the scaling efficiency (speed-up / N).

    python benchmarks/tensor_parallel.py --shape 8b --out $OUT         # Nemotron-H-8B shape
    python benchmarks/tensor_parallel.py --shape nano6 --out $OUT      # 6 layers of the Nano-30B-A3B shape
    python benchmarks/tensor_parallel.py --shape nano --out $OUT       # all 52 layers (~63 GB in bf16)
    torchrun --nproc-per-node 2 benchmarks/tensor_parallel.py --allreduce --out $OUT
    python benchmarks/tensor_parallel.py --channel --out $OUT           # CPU: step-message latency

The workers of a TP engine are separate processes that read the checkpoint, so the random bf16
weights (std 0.02; A_log, D, dt_bias and norms as in benchmarks/common.random_weights) are written
to a real safetensors folder first (``--ckpt``, reused when present). Decode time per step is
the median interval between rank 0's launches of consecutive decode-only steps (``StepClock``), the
median of 3 runs after a warm-up; ``--profile-batch`` adds rank 0's GPU time per step by kernel kind.
With ``HYBRID_ENGINE_TP_FUSED_NORM=0`` in the environment, TP > 1 runs unfused (NCCL all-reduce,
then the norm kernel; ``parallel/allreduce_norm.py``) and the JSON is ``tp-SHAPE-unfused.json``.
``--allreduce`` (under torchrun) times one NCCL all-reduce of [b, hidden] bf16 replayed from a CUDA
graph, the collective each mixer adds to a TP step. ``--channel`` (CPU, no GPU needed) times how
long a step message (a pickled 64-row steady-decode SchedulerOutput-sized object, ~5 KB) takes from
rank 0 to a worker: over gloo ``broadcast_object_list`` and over the shared-memory channel.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPE_8B, StepClock, save_json, write_config  # noqa: E402
from benchmarks.profiling import kernel_breakdown  # noqa: E402
from benchmarks.moe import SHAPE_NANO  # noqa: E402

SHAPES = {"8b": SHAPE_8B, "nano6": dict(SHAPE_NANO, pattern="MEM*EM"), "nano": SHAPE_NANO}
SHARD_BYTES = 4 << 30
# HYBRID_ENGINE_TP_FUSED_NORM=0 (inherited by the workers) measures TP > 1 with NCCL + the norm kernel
FUSED_NORM = os.environ.get("HYBRID_ENGINE_TP_FUSED_NORM", "1") != "0"


def write_checkpoint(folder: Path, shape: dict) -> Path:
    """config.json + random bf16 safetensors shards (one tensor generated at a time on the GPU)."""
    from safetensors.torch import save_file
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.models.nemotron_h import NemotronHForCausalLM
    if (folder / "model.safetensors.index.json").exists():
        return folder
    write_config(folder, shape)
    mc = ModelConfig.from_json(folder)
    with torch.device("meta"):
        model = NemotronHForCausalLM(mc)
    g = torch.Generator(device="cuda").manual_seed(0)
    weight_map, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file(shard, str(folder / name))
            weight_map.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1
    for name, t in model.state_dict().items():
        if name.endswith("A_log"):
            v = torch.rand(t.shape, generator=g, device="cuda").mul(2.7)
        elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
            v = torch.ones(t.shape, device="cuda")
        elif name.endswith("dt_bias"):
            v = torch.full(t.shape, -2.0, device="cuda")
        elif name.endswith("e_score_correction_bias"):
            v = torch.zeros(t.shape, device="cuda")
        else:
            v = torch.randn(t.shape, generator=g, device="cuda").mul_(0.02)
        keep32 = name.endswith(("e_score_correction_bias", "gate.weight"))
        shard[name] = v.to(torch.float32 if keep32 else torch.bfloat16).cpu().contiguous()
        size += shard[name].numel() * shard[name].element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def decode_rows(folder: Path, tp: int, batches, prompt_len: int, gen: int, kv_fraction: float,
                profile_batch: int | None = None) -> list[dict]:
    from hybrid_engine import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", tensor_parallel_size=tp, max_num_seqs=max(batches),
              kv_cache_memory_fraction=kv_fraction, max_model_len=prompt_len + gen + 64,
              enable_prefix_caching=False)
    build_s = time.perf_counter() - t0
    clock = StepClock(llm.engine)
    rng = np.random.default_rng(0)
    vocab = llm.engine.cfg.model.vocab_size
    rows = []
    for b in batches:
        prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(b)]
        run = lambda: llm.generate(prompts, SamplingParams(max_tokens=gen, ignore_eos=True), use_tqdm=False)  # noqa: E731
        run()                                                       # warm-up
        runs = sorted(clock.run(run) for _ in range(3))
        step = runs[1]                                              # the median run's median step
        rows.append(dict(tp=tp, batch=b, fused_allreduce_norm=tp > 1 and FUSED_NORM, step_ms=step * 1e3,
                         tok_s=b / step, build_s=build_s,
                         step_ms_runs=[round(x * 1e3, 4) for x in runs]))
        print(f"TP={tp} batch {b}: {step * 1e3:.3f} ms/step, {b / step:.1f} tok/s", flush=True)
        if b == profile_batch and gen > 8:
            steps = min(8, gen - 6)
            clock.profile = (4, steps)
            clock.run(run)
            rows[-1]["gpu_ms_per_step_rank0"] = kernel_breakdown(clock.prof, clock.profiled_steps)
            print(f"TP={tp} batch {b}, rank 0, GPU ms per step by kernel kind: {rows[-1]['gpu_ms_per_step_rank0']}",
                  flush=True)
    llm.shutdown()
    return rows


def allreduce_rows(hidden: int, batches, out: Path) -> None:
    """Under torchrun: graph-replayed all-reduce latency of [b, hidden] bf16 (median of 200)."""
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem
    name = dist.group.WORLD.group_name
    buf = symm_mem.empty(max(batches) * hidden, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buf, name)
    one_shot = lambda x: torch.ops.symm_mem.one_shot_all_reduce_copy(buf[:x.numel()], x.view(-1), "sum", name)  # noqa: E731
    rows = []
    for b in batches:
        x = torch.randn(b, hidden, device="cuda", dtype=torch.bfloat16)
        dist.all_reduce(x)
        assert torch.equal(one_shot(x).view_as(x), x * 2), "one-shot all-reduce differs from 2x (equal inputs)"
        for kind, fn in (("nccl", dist.all_reduce), ("one_shot", one_shot)):
            rows.append(dict(batch=b, hidden=hidden, kind=kind, allreduce_us=_graph_time(fn, x) * 1e6))
            if rank == 0:
                print(f"{kind} all-reduce [{b}, {hidden}] bf16 in a graph: {rows[-1]['allreduce_us']:.1f} us",
                      flush=True)
    if rank == 0:
        save_json(out / "tp-allreduce.json", rows)
    dist.distributed_c10d._abort_process_group()


def _graph_time(fn, x) -> float:
    """Median seconds of one ``fn(x)`` replayed 10 times per CUDA graph, 200 replays."""
    import torch.distributed as dist
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn(x)
    ts = []
    for _ in range(200):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / 10)
    return float(np.median(ts))


def _message():
    return {"ops": (("read", 5),), "req_ids": tuple(f"req-{i}" for i in range(64)),
            "blocks": np.arange(64 * 8), "t": 0.0}


def channel_worker(kind: str, rank: int, port: int, name: str | None, n: int, writer=None) -> None:
    """One side of the latency test: rank 0 writes (through ``writer`` for shm), rank 1 reads."""
    import pickle
    import torch.distributed as dist
    from hybrid_engine.parallel.channel import ShmChannel
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    ch = ShmChannel(name, readers=1, reader=0) if rank == 1 and kind == "shm" else None
    lat = []
    for i in range(n):
        if rank == 0:
            msg = _message()
            msg["t"] = time.perf_counter()
            if kind == "shm":
                writer.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
            else:
                dist.broadcast_object_list([msg], src=0)
            time.sleep(0.002)                          # one message per "step"
        else:
            if kind == "shm":
                msg = pickle.loads(ch.recv())
            else:
                box = [None]
                dist.broadcast_object_list(box, src=0)
                msg = box[0]
            lat.append(time.perf_counter() - msg["t"])
    if ch is not None:
        ch.close()
    if rank == 1:
        print(json.dumps({"kind": kind, "median_us": float(np.median(lat[20:])) * 1e6,
                          "p90_us": float(np.percentile(lat[20:], 90)) * 1e6}), flush=True)
    dist.barrier()
    dist.destroy_process_group()



def channel_rows(out: Path, n: int = 300) -> None:
    """Step-message latency, rank 0 -> worker, for gloo and the shared-memory channel (CPU)."""
    import subprocess
    from benchmarks.common import save_json as _save
    from hybrid_engine.parallel.channel import ShmChannel
    from hybrid_engine.parallel.group import free_port
    rows = []
    for kind in ("gloo", "shm"):
        port = free_port()
        writer = ShmChannel(None, readers=1) if kind == "shm" else None
        code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r}); "
                f"from benchmarks.tensor_parallel import channel_worker; "
                f"channel_worker({kind!r}, 1, {port}, {writer.name if writer else None!r}, {n})")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        channel_worker(kind, 0, port, None, n, writer)
        line = p.communicate(timeout=120)[0].strip().splitlines()[-1]
        rows.append(json.loads(line))
        print(line, flush=True)
        if writer is not None:
            writer.close(unlink=True)
    _save(out / "tp-channel.json", rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--kv-fraction", type=float, default=0.3)
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/hybrid-engine-tp-bench"))
    ap.add_argument("--profile-batch", type=int, default=1,
                    help="also break rank 0's GPU time per decode step down by kernel kind at this batch")
    ap.add_argument("--allreduce", action="store_true")
    ap.add_argument("--channel", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.channel:
        channel_rows(args.out)
        return 0
    if args.allreduce:
        allreduce_rows(4096 if args.shape == "8b" else SHAPES[args.shape]["hidden_size"], args.batches, args.out)
        return 0
    t0 = time.perf_counter()
    folder = write_checkpoint(args.ckpt / args.shape, SHAPES[args.shape])
    print(f"checkpoint ready in {time.perf_counter() - t0:.0f} s: {folder}", flush=True)
    rows = []
    for tp in args.tp:
        rows += decode_rows(folder, tp, args.batches, args.prompt_len, args.gen, args.kv_fraction, args.profile_batch)
        gc.collect()                      # the engine is gone: give its memory back before the next
        torch.cuda.empty_cache()
    base = {r["batch"]: r["tok_s"] for r in rows if r["tp"] == 1}
    for r in rows:
        if r["batch"] in base:
            r["speedup_vs_tp1"] = r["tok_s"] / base[r["batch"]]
            r["scaling_efficiency"] = r["speedup_vs_tp1"] / r["tp"]
    save_json(args.out / f"tp-{args.shape}{'' if FUSED_NORM else '-unfused'}.json", rows)
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
