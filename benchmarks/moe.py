"""MoE benchmark: the fused MoE kernels against the dense torch path and a per-expert loop, and the
full NVIDIA-Nemotron-3-Nano-30B-A3B shape end to end on random bfloat16 weights (no checkpoint),
each beside its roofline.

    python benchmarks/moe.py --out $OUT                       # H100 80 GB, ~5 min: Nano-30B-A3B shape
    python benchmarks/moe.py --shape tiny --device cpu        # the same rows on a tiny shape, on CPU

Kernel rows (one MoE layer of the shape, then one Nemotron-3-Super expert layer: 512 experts,
top-22, on the 1024-wide latent): per token count, ms of the fused path (Triton on CUDA;
gather-by-expert on CPU), of the dense torch path (every expert over every token, weighted) and
of a per-expert loop (each hit expert over its tokens, as transformers); the bytes roofline
counts the unique experts the routing selected.
End to end: decode tokens/s at each batch beside the roofline of the bytes a step reads: dense
weights (everything but the routed experts and the embedding table) + the expected number of
distinct routed experts per layer per step (from the per-expert token counts of the run, assuming
tokens route independently) + b embedding rows + Mamba states + KV; memory bandwidth is
measured in the same run (device copy). Prefill tokens/s beside the measured bf16 matmul peak,
counting the FLOPs of dense weights, the selected experts only, and attention, with the routing's
grouped-GEMM tiles a layer (each expert's rows rounded up to whole tiles of the engine's rows per
tile; ``moe_roofline.expert_tiles``) and the largest expert's rows.
``--quantization fp8``: the end-to-end rows with the weights quantized at load (FP8 linears and
routed experts; issue 17's "30B-A3B shape in FP8"), their roofline counting the bytes as stored.
``--hf-batches 1 8``: at those decode batches, transformers' greedy ``generate`` on the engine's own
weight tensors (``common.hf_twin``: assigned, not copied, so the full shape fits one GPU),
its decode tok/s, the engine's ratio to it, and how many greedy tokens agree. transformers runs
whatever kernels it finds (its torch fallbacks without mamba-ssm / causal-conv1d).
Prints a markdown table; writes ``moe-<shape>-<device>[-fp8].json`` to --out.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (copy_bandwidth, hf_greedy_decode, hf_twin, save_json, step_clock,  # noqa: E402
                               write_config)
from benchmarks.profiling import prefill_gaps, profile_prefill  # noqa: E402
from benchmarks.moe_roofline import (distinct_experts, expert_tiles, param_split, prefill_flops, step_state_bytes,  # noqa: E402
                                     weight_split)
from hybrid_engine import LLM, SamplingParams  # noqa: E402
from hybrid_engine.models import moe_ops  # noqa: E402
from hybrid_engine.models.moe_align import align_block_size  # noqa: E402

# NVIDIA-Nemotron-3-Nano-30B-A3B (published config.json); widths for NemotronHConfig
SHAPE_NANO = dict(pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", hidden_size=2688,
                  num_attention_heads=32, num_key_value_heads=2, head_dim=128, intermediate_size=1856,
                  mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4,
                  chunk_size=128, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
                  moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=2.5, vocab_size=131072)
SHAPE_TINY = dict(SHAPE_NANO, pattern="MEM*EME", hidden_size=64, num_attention_heads=4, head_dim=16,
                  intermediate_size=32, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16,
                  n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                  moe_shared_expert_intermediate_size=64, vocab_size=512)
SHAPES = {"nano": SHAPE_NANO, "tiny": SHAPE_TINY}
# one Nemotron-3-Super-120B-A12B expert layer (kernel rows only): experts on the 1024-wide latent
SUPER_LAYER = dict(n_routed_experts=512, num_experts_per_tok=22, hidden_size=1024, moe_intermediate_size=2688,
                   routed_scaling_factor=5.0)
TINY_LATENT_LAYER = dict(SUPER_LAYER, n_routed_experts=64, num_experts_per_tok=8, hidden_size=32,
                         moe_intermediate_size=48)


# ------------------------------------------------------------------------------------ timing

def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, dev, warmup=1, iters=5) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def matmul_peak(dev, dtype, n: int) -> float:
    """FLOP/s of an n x n x n matmul in dtype."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = timeit(lambda: a @ b, dev, warmup=2, iters=7)
    return 2 * n ** 3 / t


# ------------------------------------------------------------------------------------ kernel rows

def kernel_rows(shape: dict, dev, dtype, token_counts, bw: float, peak: float) -> list[dict]:
    E, k = shape["n_routed_experts"], shape["num_experts_per_tok"]
    D, F = shape["hidden_size"], shape["moe_intermediate_size"]
    g = torch.Generator(device=dev).manual_seed(0)
    up = (torch.randn(E, F, D, device=dev, dtype=dtype, generator=g) / D ** 0.5)
    down = (torch.randn(E, D, F, device=dev, dtype=dtype, generator=g) / F ** 0.5)
    gate = torch.randn(E, D, device=dev, generator=g) / D ** 0.5
    spec = moe_ops.RouteSpec(num_experts=E, top_k=k, scale=shape["routed_scaling_factor"])
    bias = torch.zeros(E, device=dev)
    expert_bytes = 2 * F * D * up.element_size()
    rows = []
    for T in token_counts:
        x = torch.randn(T, D, device=dev, dtype=dtype, generator=g)
        ids, w = moe_ops.route(torch.nn.functional.linear(x.float(), gate), bias, spec)
        uniq = int(torch.unique(ids).numel())
        fused = timeit(lambda: moe_ops.routed_experts(x, up, down, ids, w), dev)
        dense = timeit(lambda: moe_ops.dense_experts_ref(x, up, down, ids, w), dev, warmup=1, iters=2)
        loop = timeit(lambda: moe_ops.grouped_experts_ref(x, up, down, ids.long(), w), dev, warmup=1, iters=3)
        roof_s = max(uniq * expert_bytes / bw, 2 * T * k * 2 * D * F / peak)
        rows.append(dict(tokens=T, distinct_experts=uniq, fused_ms=fused * 1e3, dense_ms=dense * 1e3,
                         loop_ms=loop * 1e3, roofline_ms=roof_s * 1e3, frac_roofline=roof_s / fused))
        print(f"kernel T={T}: fused {fused * 1e3:.3f} ms, dense {dense * 1e3:.3f} ms, loop {loop * 1e3:.3f} ms, "
              f"roofline {roof_s * 1e3:.3f} ms", flush=True)
    del up, down
    return rows


# ------------------------------------------------------------------------------------ end to end

def first_token_gaps(hf, prompts, engine_first: list[int]) -> dict:
    """Where the engine's first greedy token sits in transformers' own last-position logits (float32
    copies of them), per prompt: transformers' top-1 minus top-2 logit, and its top-1 minus the
    logit of the engine's pick (0: the same token). A differing pick whose gap is within the noise
    of 16-bit arithmetic, against a top-2 gap of the same size, is a near tie rather than a bug."""
    ids = torch.tensor(prompts, device=next(hf.parameters()).device)
    with torch.no_grad():
        logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[:, -1].float()     # [B, V]
    top2 = logits.topk(2, dim=-1).values
    picked = logits.gather(1, torch.tensor(engine_first, device=logits.device)[:, None])[:, 0]
    r = lambda t: [round(v, 4) for v in t.tolist()]                                    # noqa: E731
    return dict(logit_std=float(logits.std()), hf_top2_gap=r(top2[:, 0] - top2[:, 1]),
                engine_pick_gap=r(top2[:, 0] - picked))


def build_llm(model_dir: Path, dev, dtype, max_seqs: int, max_tokens: int, kv_fraction: float, **engine_kw):
    """The engine on random weights made on the device (no checkpoint read); ``engine_kw`` go to
    ``LLM`` (e.g. ``prefill_cuda_graphs=False``)."""
    import hybrid_engine.models.loader as loader

    def fill(model, _dir, dtype=None, device=None, *a, **kw):
        g = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("A_log"):
                    p.copy_(torch.rand(p.shape, generator=g, device=p.device).mul(2.7).to(p.dtype))
                elif name.endswith(("norm.weight", "norm_f.weight", ".D")):
                    p.fill_(1.0)
                elif name.endswith("dt_bias"):
                    p.fill_(-2.0)
                elif name.endswith("gate.weight"):         # the router: float32, O(1) logits
                    p.data = torch.randn(p.shape, device=p.device, generator=g) / p.shape[1] ** 0.5
                else:
                    p.normal_(0.0, 0.02, generator=g)
            for name, b in model.named_buffers():
                b.data = torch.zeros_like(b, dtype=torch.float32) if name.endswith("correction_bias") else b.zero_()
        return model
    orig = loader.load_checkpoint
    loader.load_checkpoint = fill
    try:
        return LLM(model_dir, dtype=dtype, device=str(dev), max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                   max_model_len=max_tokens + 256, kv_cache_memory_fraction=kv_fraction,
                   kv_cache_bytes=64 << 20, enable_prefix_caching=False, **engine_kw)
    finally:
        loader.load_checkpoint = orig


def e2e(shape: dict, dev, dtype, batches, prefill_lens, gen: int, prompt_len: int, bw: float, peak: float,
        kv_fraction: float, profile_lens=(), hf_batches=(), hf_tokens: int = 8, **engine_kw) -> dict:
    tmp = Path(tempfile.mkdtemp())
    model_dir = write_config(tmp / "m", shape)
    t0 = time.perf_counter()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)       # the build's own peak, not the kernel rows'
    llm = build_llm(model_dir, dev, dtype, max(batches), max(prefill_lens + [2048]), kv_fraction, **engine_kw)
    model, mc = llm.engine.model, llm.engine.cfg.model
    dense, per_expert, emb = weight_split(model)
    moe_layers = len([1 for n, _ in model.named_parameters() if n.endswith("experts.up_proj")])
    # the most memory held while building (loading, quantizing at load, KV cache, graphs)
    build_peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    print(f"engine ready in {time.perf_counter() - t0:.0f}s: dense {dense / 1e9:.2f} GB, "
          f"{moe_layers} MoE layers x {mc.n_routed_experts} experts x {per_expert / 1e6:.1f} MB, "
          f"peak GPU memory while building {build_peak / 1e9:.1f} GB", flush=True)
    rng = np.random.default_rng(0)
    params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True)   # noqa: E731
    out = {"decode": [], "prefill": [], "build_peak_GB": build_peak / 1e9,
           "weights_GB": (dense + moe_layers * mc.n_routed_experts * per_expert + emb) / 1e9}
    hf = hf_twin(model, model_dir) if hf_batches else None
    if hf is not None:
        out["transformers"] = []
    for b in batches:
        prompts = [rng.integers(3, mc.vocab_size, prompt_len).tolist() for _ in range(b)]
        llm.generate(prompts, params(2), use_tqdm=False)                               # warm-up
        llm.stats()                                                                      # clear counters
        step = step_clock(llm).step_time(lambda: llm.generate(prompts, params(gen), use_tqdm=False), runs=2, warmup=0)
        load = llm.stats().get("moe_expert_tokens", {})
        uniq = []
        for counts in load.values():       # p[e]: chance a token picks e (sums to k)
            c = np.asarray(counts, dtype=np.float64)
            uniq.append(distinct_experts(c / max(c.sum() / mc.num_experts_per_tok, 1.0), b))
        step_bytes = (dense + b * mc.hidden_size * 2 + sum(uniq) * per_expert
                      + b * step_state_bytes(mc, prompt_len + gen // 2))
        roof = b * bw / step_bytes
        out["decode"].append(dict(batch=b, tok_s=b / step, step_ms=step * 1e3, step_GB=step_bytes / 1e9,
                                  distinct_experts_per_layer=sum(uniq) / max(len(uniq), 1),
                                  roofline_tok_s=roof, frac_roofline=(b / step) / roof))
        print(f"decode b={b}: {b / step:.1f} tok/s, step {step * 1e3:.2f} ms, roofline {roof:.1f} tok/s "
              f"({100 * (b / step) / roof:.0f}%)", flush=True)
        if hf is not None and b in hf_batches:
            row = hf_greedy_decode(hf, prompts, hf_tokens, sync=(lambda: _sync(dev)))
            ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params(hf_tokens), use_tqdm=False)]
            theirs = row.pop("tokens")
            row.update(engine_over_transformers=(b / step) / row["tok_s"],
                       equal_sequences=sum(list(a) == t for a, t in zip(ours, theirs)),
                       equal_prefix_tokens=sum(next((i for i, (x, y) in enumerate(zip(a, t)) if x != y), len(t))
                                               for a, t in zip(ours, theirs)) / (b * hf_tokens))
            row.update(first_token_gaps(hf, prompts, [o[0] for o in ours]))
            out["transformers"].append(row)
            print(f"transformers b={b}: {row['tok_s']:.2f} tok/s, step {row['step_ms']:.1f} ms (the engine "
                  f"{row['engine_over_transformers']:.1f}x); greedy {hf_tokens} tokens: {row['equal_sequences']}/{b} "
                  f"sequences equal, {100 * row['equal_prefix_tokens']:.0f}% of tokens before the first "
                  f"difference; first token, in transformers' logits (std {row['logit_std']:.2f}): its top-1 "
                  f"minus top-2 {row['hf_top2_gap']}, its top-1 minus the engine's pick {row['engine_pick_gap']}",
                  flush=True)
    for n in prefill_lens:
        prompt = rng.integers(3, mc.vocab_size, n).tolist()
        llm.stats()                                                                      # clear counters
        try:
            t = timeit(lambda: llm.generate([prompt], params(1), use_tqdm=False), dev, warmup=1, iters=5)
        except torch.OutOfMemoryError:
            print(f"prefill {n}: out of memory", flush=True)
            torch.cuda.empty_cache()
            continue
        flops = prefill_flops(mc, n, *param_split(model), moe_layers)
        pairs = n * mc.num_experts_per_tok
        tiles = expert_tiles(llm.stats().get("moe_expert_tokens", {}), pairs,
                             align_block_size(pairs, mc.n_routed_experts, engine_kw.get("quantization") == "fp8"))
        out["prefill"].append(dict(tokens=n, tok_s=n / t, ms=t * 1e3, tflops=flops / t / 1e12,
                                   frac_matmul_peak=flops / t / peak, routing=tiles))
        print(f"prefill {n}: {n / t:.0f} tok/s, {flops / t / 1e12:.1f} TFLOP/s ({100 * flops / t / peak:.0f}% of "
              f"matmul peak)" + (f"; {tiles['tiles_per_layer']:.0f} expert tiles of {tiles['block_m']} rows a layer "
                                 f"(largest expert {tiles['largest_expert_rows']:.0f} rows)" if tiles else ""),
              flush=True)
        if n in profile_lens:
            out["prefill"][-1]["profile"] = profile_prefill(llm, prompt, params(1))
            out["prefill"][-1]["gaps"] = prefill_gaps(llm, prompt, params(1))
    del llm, hf
    gc.collect()
    return out


def cpu_vs_transformers(gen: int = 16) -> dict:
    """16-token greedy generation on a reduced Nano copy (52 layers, 128 experts, top-6): engine
    vs transformers on CPU, float32."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from hf_reference import hf_greedy, load_hf
    from hybrid_engine.models.synthetic import make_hf_model
    d = make_hf_model(Path(tempfile.mkdtemp()) / "nano", seed=11, **{
        **{k: v for k, v in SHAPE_NANO.items() if k not in ("hidden_size", "head_dim", "mamba_num_heads",
                                                              "mamba_head_dim", "n_groups", "ssm_state_size",
                                                              "moe_intermediate_size", "intermediate_size",
                                                              "moe_shared_expert_intermediate_size",
                                                              "vocab_size")},
        "hidden_size": 32, "head_dim": 8, "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2,
        "ssm_state_size": 8, "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 32,
        "intermediate_size": 16, "vocab_size": 256})
    prompt = np.random.default_rng(0).integers(3, 256, 32).tolist()
    load_hf(d)
    hf_greedy(d, [prompt], 2)
    t_hf = timeit(lambda: hf_greedy(d, [prompt], gen), torch.device("cpu"), warmup=0, iters=3)
    llm = LLM(d, dtype="float32", device="cpu", max_num_seqs=1, enable_prefix_caching=False)   # repeated prompt
    sp = SamplingParams(max_tokens=gen, ignore_eos=True)
    t_us = timeit(lambda: llm.generate([prompt], sp, use_tqdm=False), torch.device("cpu"), warmup=1, iters=3)
    same = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(d, [prompt], gen)[0]
    print(f"CPU reduced Nano, {gen} tokens: engine {t_us:.2f}s, transformers {t_hf:.2f}s "
          f"({t_hf / t_us:.2f}x), same tokens: {same}", flush=True)
    return dict(engine_s=t_us, transformers_s=t_hf, speedup=t_hf / t_us, same_tokens=same)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="nano")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--kv-fraction", type=float, default=0.15)
    ap.add_argument("--profile-prefill", type=int, nargs="*", default=[],
                    help="prefill lengths (of --prefill) to also profile by kernel and by GPU idle gap (CUDA)")
    ap.add_argument("--no-prefill-graphs", action="store_true", help="prefill_cuda_graphs=False (eager prefills)")
    ap.add_argument("--quantization", choices=["fp8", "nvfp4"], default=None,
                    help="end-to-end rows only: LLM(quantization=...) quantizes the random weights at load "
                         "(FP8: per-channel linears, per-expert routed experts); the roofline counts the "
                         "stored bytes, the prefill percentage stays against the bf16 matmul peak")
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-super-layer", action="store_true", help="no kernel rows for the Super latent layer")
    ap.add_argument("--vs-transformers", action="store_true", help="CPU: also time transformers on a reduced Nano")
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[],
                    help="end-to-end rows: at these decode batches (of --batches) also time transformers' greedy "
                         "generate on the engine's own weight tensors (shared, not copied; bf16 only)")
    ap.add_argument("--hf-tokens", type=int, default=8, help="tokens per transformers generate (--hf-batches)")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    if args.hf_batches and args.quantization:
        ap.error("--hf-batches: transformers runs the engine's bf16 tensors; a quantized engine has none to share")
    if not set(args.hf_batches) <= set(args.batches) or args.hf_tokens < 2:
        ap.error(f"--hf-batches must be among --batches {args.batches}, and --hf-tokens at least 2")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    big = dev.type == "cuda"
    bw = copy_bandwidth((1 << 30) if big else (64 << 20), dev)
    peak = matmul_peak(dev, dtype, 8192 if big else 512)
    res = dict(shape=args.shape, device=torch.cuda.get_device_name() if big else "cpu", dtype=str(dtype),
               quantization=args.quantization, copy_bw_TBps=bw / 1e12, matmul_peak_TFLOPs=peak / 1e12,
               command=" ".join(sys.argv))
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s, {dtype} matmul peak {peak / 1e12:.1f} TFLOP/s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"moe-{args.shape}-{dev.type}{'-' + args.quantization if args.quantization else ''}.json"
    if args.quantization and not args.skip_kernels:
        print("note: the kernel rows stay bf16; --quantization applies to the end-to-end rows", flush=True)
    if not args.skip_kernels:
        res["kernels"] = kernel_rows(shape, dev, dtype, args.tokens, bw, peak)
        save_json(path, res)
        if not args.skip_super_layer:
            print("Super-120B latent expert layer:", flush=True)
            layer = SUPER_LAYER if args.shape == "nano" else TINY_LATENT_LAYER
            res["kernels_super_layer"] = kernel_rows(layer, dev, dtype, args.tokens, bw, peak)
            save_json(path, res)
        gc.collect()
        if big:
            torch.cuda.empty_cache()
    if not args.skip_e2e:
        res.update(e2e(shape, dev, dtype, args.batches, args.prefill, args.gen, args.prompt_len, bw, peak,
                       args.kv_fraction, profile_lens=set(args.profile_prefill),
                       hf_batches=set(args.hf_batches), hf_tokens=args.hf_tokens,
                       **({"prefill_cuda_graphs": False} if args.no_prefill_graphs else {}),
                       **({"quantization": args.quantization} if args.quantization else {})))
        save_json(path, res)
    if args.vs_transformers:
        res["cpu_vs_transformers"] = cpu_vs_transformers()
        save_json(path, res)
    quant_tag = f", {args.quantization}" if args.quantization else ""
    print(f"\n### MoE {args.shape} on {res['device']} ({dtype}{quant_tag}; copy {bw / 1e12:.2f} TB/s, "
          f"matmul {peak / 1e12:.0f} TFLOP/s)\n")
    for key, title in (("kernels", f"{args.shape} MoE layer"), ("kernels_super_layer", "Super latent expert layer")):
        if key not in res:
            continue
        print(f"\n{title}:\n")
        print("| tokens | distinct experts | fused ms | dense torch ms | per-expert loop ms | roofline ms | % roofline |")
        print("|---|---|---|---|---|---|---|")
        for r in res[key]:
            print(f"| {r['tokens']} | {r['distinct_experts']} | {r['fused_ms']:.3f} | {r['dense_ms']:.3f} | "
                  f"{r['loop_ms']:.3f} | {r['roofline_ms']:.3f} | {100 * r['frac_roofline']:.0f}% |")
    if "decode" in res:
        print("\n| decode batch | tok/s | step ms | GB read/step | distinct experts/layer | roofline tok/s | % roofline |")
        print("|---|---|---|---|---|---|---|")
        for r in res["decode"]:
            print(f"| {r['batch']} | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {r['step_GB']:.2f} | "
                  f"{r['distinct_experts_per_layer']:.1f} | {r['roofline_tok_s']:.1f} | {100 * r['frac_roofline']:.0f}% |")
        print("\n| prefill tokens | tok/s | TFLOP/s | % matmul peak |")
        print("|---|---|---|---|")
        for r in res["prefill"]:
            print(f"| {r['tokens']} | {r['tok_s']:.0f} | {r['tflops']:.1f} | {100 * r['frac_matmul_peak']:.0f}% |")
    if res.get("transformers"):
        print(f"\n| decode batch | transformers tok/s | engine / transformers | greedy sequences equal "
              f"({args.hf_tokens} tokens) | tokens before the first difference |")
        print("|---|---|---|---|---|")
        for r in res["transformers"]:
            print(f"| {r['batch']} | {r['tok_s']:.2f} | {r['engine_over_transformers']:.1f}x | "
                  f"{r['equal_sequences']}/{r['batch']} | {100 * r['equal_prefix_tokens']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
