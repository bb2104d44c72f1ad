"""Quantized weights on the Nemotron-H-8B shape: decode tokens/s of bf16, FP8 and NVFP4
(weight-only) beside each one's byte roofline, prefill tokens/s bf16 vs FP8; ratios to bf16 from
the same run.

    python benchmarks/quant.py --shape 8b --out $OUT        # H100
    python benchmarks/quant.py --device cpu                 # CPU smoke: tiny shape, a few tokens

Weights are random (``benchmarks.common.random_weights``); FP8 / NVFP4 are ``LLM(quantization=...)``
quantizing them at load (FP8 per-channel scales). Each mode is built, measured and freed before
the next. Decode: the median interval between consecutive decode-only step launches
(``benchmarks.common.StepClock``, median of 3 runs), as benchmarks/e2e.py. Roofline: (parameter bytes as stored + per-row Mamba state and KV bytes) /
measured copy bandwidth. Paths: FP8 decode <= 8 rows runs the Triton FP8 skinny kernels and larger
batches ``torch._scaled_mm`` W8A8; NVFP4 <= 128 rows runs the Triton NVFP4 kernel.
Writes ``quant-<shape>.json`` to --out and prints a table.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (SHAPE_8B, SHAPE_SMALL, median_time, random_weights, save_json,  # noqa: E402
                               step_clock, write_config)
from hybrid_engine import LLM, SamplingParams  # noqa: E402

SHAPE_TINY = dict(pattern="M-M*-", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                  vocab_size=512)
MODES = {"bf16": None, "fp8": "fp8", "nvfp4": "nvfp4"}


def state_bytes_per_row(mc) -> int:
    ssm = mc.mamba_num_heads * mc.mamba_head_dim * mc.ssm_state_size * 4
    conv = mc.conv_dim * (mc.conv_kernel - 1) * 2
    return len(mc.mamba_layer_ids) * (2 * ssm + 2 * conv)


def kv_bytes_per_row(mc, ctx: int) -> int:
    return len(mc.attention_layer_ids) * ctx * mc.num_key_value_heads * mc.head_dim * 2 * 2


def wall(fn, warmup: int, iters: int, sync) -> float:
    return median_time(fn, warmup=warmup, iters=iters, sync=sync)


def copy_bandwidth(device) -> float:
    if device.type != "cuda":
        return float("nan")
    from benchmarks.common import copy_bandwidth as cb
    return cb()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["8b", "small", "tiny"], default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=None)
    ap.add_argument("--prefill", type=int, default=None, help="prefill length (0: skip)")
    ap.add_argument("--prefill-modes", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    dev = torch.device(args.device)
    cpu = dev.type == "cpu"
    shape_name = args.shape or ("tiny" if cpu else "8b")
    shape = {"8b": SHAPE_8B, "small": SHAPE_SMALL, "tiny": SHAPE_TINY}[shape_name]
    batches = args.batches or ([1, 2] if cpu else [1, 8, 32, 128])
    gen = args.gen or (4 if cpu else 64)
    prefill = args.prefill if args.prefill is not None else (64 if cpu else 8192)
    sync = torch.cuda.synchronize if not cpu else (lambda: None)
    iters, warmup = (1, 0) if cpu else (3, 1)
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp())
    model_dir = write_config(tmp / shape_name, shape)
    bw = copy_bandwidth(dev)
    res = dict(shape=shape_name, device=torch.cuda.get_device_name() if not cpu else "cpu",
               torch=torch.__version__, copy_bw_TBps=bw / 1e12, command=" ".join(sys.argv), modes={})
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / f"quant-{shape_name}.json"
    print(f"{shape_name} on {res['device']}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for mode in args.modes:
        t0 = time.perf_counter()
        with random_weights():
            llm = LLM(model_dir, dtype="bfloat16" if not cpu else "float32", device=dev,
                      quantization=MODES[mode], max_num_seqs=max(batches),
                      max_num_batched_tokens=max(prefill, 2048), max_model_len=max(prefill, 2048) + 128,
                      kv_cache_memory_fraction=0.25, kv_cache_bytes=64 << 20, enable_prefix_caching=False)
        mc = llm.engine.cfg.model
        model = llm.engine.model
        wbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        emb = model.backbone.embeddings.weight
        gathered = emb.numel() * emb.element_size()      # embeddings: only the rows looked up are read
        row = dict(weight_bytes=wbytes, build_s=time.perf_counter() - t0, decode=[], prefill=None)
        print(f"{mode}: {wbytes / 1e9:.2f} GB of weights, built in {row['build_s']:.1f}s", flush=True)
        for b in batches:
            prompts = [rng.integers(3, mc.vocab_size, args.prompt_len).tolist() for _ in range(b)]
            run = lambda n: llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)  # noqa: E731
            step = step_clock(llm).step_time(lambda: run(gen), runs=iters, warmup=warmup)
            ctx = args.prompt_len + gen // 2
            step_bytes = wbytes - gathered + b * (mc.hidden_size * emb.element_size() + state_bytes_per_row(mc)
                                                  + kv_bytes_per_row(mc, ctx))
            roof = b * bw / step_bytes
            d = dict(batch=b, tok_s=b / step, step_ms=step * 1e3, roofline_tok_s=roof, frac_roofline=b / step / roof)
            row["decode"].append(d)
            print(f"  decode b={b}: {d['tok_s']:.1f} tok/s, step {d['step_ms']:.2f} ms, roofline {roof:.1f} "
                  f"({100 * d['frac_roofline']:.0f}%)", flush=True)
        if prefill and mode in args.prefill_modes:
            prompt = rng.integers(3, mc.vocab_size, prefill).tolist()
            t = wall(lambda: llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False), warmup, iters, sync)
            row["prefill"] = dict(prompt_len=prefill, tok_s=prefill / t, ms=t * 1e3)
            print(f"  prefill {prefill}: {prefill / t:.0f} tok/s ({t * 1e3:.1f} ms)", flush=True)
        res["modes"][mode] = row
        save_json(out_json, res)                   # partial results survive a time-out
        del llm, model, emb
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()
    base = res["modes"].get("bf16")
    print("\n| mode | weights GB | " + " | ".join(f"b={b} tok/s (% roof, x bf16)" for b in batches) + " | prefill tok/s (x bf16) |")
    print("|---|---|" + "---|" * len(batches) + "---|")
    for mode, row in res["modes"].items():
        cells = []
        for i, d in enumerate(row["decode"]):
            x = d["tok_s"] / base["decode"][i]["tok_s"] if base else float("nan")
            d["x_bf16"] = x
            cells.append(f"{d['tok_s']:.1f} ({100 * d['frac_roofline']:.0f}%, x{x:.2f})")
        p = row["prefill"]
        if p and base and base["prefill"]:
            p["x_bf16"] = p["tok_s"] / base["prefill"]["tok_s"]
        pcell = f"{p['tok_s']:.0f} (x{p.get('x_bf16', float('nan')):.2f})" if p else "-"
        print(f"| {mode} | {row['weight_bytes'] / 1e9:.2f} | " + " | ".join(cells) + f" | {pcell} |")
    save_json(out_json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
