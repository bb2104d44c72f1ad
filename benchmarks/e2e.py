"""End-to-end benchmarks on random bfloat16 weights (CUDA): decode tokens/s vs transformers
``generate`` on the same tensors and vs the bandwidth roofline, prefill tokens/s, spec speedup.

    python benchmarks/e2e.py --shape 8b --out $OUT        # the Nemotron-H-8B shape (~8.1B params)
    python benchmarks/e2e.py --shape small --out $OUT     # a small shape where Python overhead dominates

Writes ``e2e-<shape>.json`` (all numbers) to --out and prints a summary table.
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
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (SHAPE_8B, SHAPE_SMALL, copy_bandwidth, cuda_time, hf_greedy_decode, hf_twin,  # noqa: E402
                               random_weights, save_json, step_clock, write_config)
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig  # noqa: E402


def state_bytes_per_row(mc, s: int) -> int:
    """Mamba state bytes one row reads and writes in a step of s tokens (SSM f32 + conv bf16)."""
    ssm = mc.mamba_num_heads * mc.mamba_head_dim * mc.ssm_state_size * 4
    conv = mc.conv_dim * (mc.conv_kernel - 1 + s - 1) * 2
    return len(mc.mamba_layer_ids) * (ssm * (1 + s) + 2 * conv)


def kv_bytes_per_row(mc, seq_len: int) -> int:
    return len(mc.attention_layer_ids) * seq_len * mc.num_key_value_heads * mc.head_dim * 2 * 2


def timed_generate(llm, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return cuda_time(lambda: llm.generate(prompts, params, use_tqdm=False), warmup=1, iters=3)


def bench_decode(llm, hf, mc, batches, prompt_len, gen, bw, weight_bytes, hf_batches, hf_gen, rng,
                 embed_bytes=0):
    rows = []
    for b in tqdm(batches, desc="decode"):
        prompts = [rng.integers(3, mc.vocab_size, prompt_len).tolist() for _ in range(b)]
        params = SamplingParams(max_tokens=gen, ignore_eos=True)
        step = step_clock(llm).step_time(lambda: llm.generate(prompts, params, use_tqdm=False))
        ours = b / step
        ctx = prompt_len + gen // 2
        step_bytes = weight_bytes + b * (state_bytes_per_row(mc, 1) + kv_bytes_per_row(mc, ctx))
        roof = b * bw / step_bytes
        # strict: the input embedding table is gathered, not read: only b of its rows count
        strict_bytes = step_bytes - embed_bytes + b * mc.hidden_size * 2
        strict = b * bw / strict_bytes
        row = dict(batch=b, ours_tok_s=ours, step_ms=step * 1e3, roofline_tok_s=roof, frac_roofline=ours / roof,
                   roofline_strict_tok_s=strict, frac_roofline_strict=ours / strict)
        if hf is not None and b in hf_batches:
            try:
                hf_tps = hf_greedy_decode(hf, prompts, hf_gen, sync=torch.cuda.synchronize, iters=1)["tok_s"]
                row.update(hf_tok_s=hf_tps, speedup_vs_hf=ours / hf_tps)
            except torch.OutOfMemoryError:           # transformers' torch-fallback scan is memory-hungry
                row.update(hf_tok_s=None, hf_note="transformers OOM")
                torch.cuda.empty_cache()
        rows.append(row)
    return rows


def bench_prefill(llm, mc, lengths, rng):
    rows = []
    for n in lengths:
        prompt = rng.integers(3, mc.vocab_size, n).tolist()
        t = timed_generate(llm, [prompt], 1)
        rows.append(dict(prompt_len=n, ours_tok_s=n / t, ms=t * 1e3))
    return rows


def repetitive_prompts(mc, b, rng, length=96):
    out = []
    for _ in range(b):
        motif = rng.integers(3, mc.vocab_size, 12).tolist()
        out.append((motif * (length // 12 + 1))[:length])
    return out


def bench_spec(model_dir, draft_dir, mc, batches, gen, rng, k=3):
    rows = []
    specs = {"none": None, "ngram": SpeculativeConfig("ngram", k)}
    if draft_dir is not None:
        specs["draft_model"] = SpeculativeConfig("draft_model", k, model=str(draft_dir))
    for name, spec in specs.items():
        with random_weights():
            llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_seqs=max(batches),
                      max_num_batched_tokens=4096, speculative_config=spec, max_model_len=4096,
                      kv_cache_memory_fraction=0.25, enable_prefix_caching=False)
        for b in batches:
            prompts = repetitive_prompts(mc, b, rng)
            t_all = timed_generate(llm, prompts, gen)
            t_pre = timed_generate(llm, prompts, 1)
            before = llm.stats()
            llm.generate(prompts, SamplingParams(max_tokens=gen, ignore_eos=True), use_tqdm=False)
            st = llm.stats()
            steps = max(1, (st.get("verify_steps", 0) - before.get("verify_steps", 0)) // b)
            acc = st["drafts_accepted"] - before["drafts_accepted"]
            prop = st["drafts_proposed"] - before["drafts_proposed"]
            rows.append(dict(method=name, batch=b, tok_s=b * (gen - 1) / (t_all - t_pre),
                             step_ms=(t_all - t_pre) / steps * 1e3,
                             acceptance_length=(1 + acc / (steps * b)) if spec else 1.0,
                             acceptance_rate=(acc / prop) if prop else 0.0))
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["batch"]: r for r in rows if r["method"] == "none"}
    for r in rows:
        r["speedup"] = r["tok_s"] / base[r["batch"]]["tok_s"]
        r["target_speedup"] = 0.8 * r["acceptance_length"] * base[r["batch"]]["step_ms"] / r["step_ms"] \
            if r["method"] != "none" else 1.0
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["8b", "small"], default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--hf-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--hf-gen", type=int, default=16)
    ap.add_argument("--prefill", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--spec-batches", type=int, nargs="*", default=[1, 32])
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    tmp = Path(tempfile.mkdtemp())
    shape = SHAPE_8B if args.shape == "8b" else SHAPE_SMALL
    model_dir = write_config(tmp / args.shape, shape)
    bw = copy_bandwidth()
    t0 = time.perf_counter()
    with random_weights():
        llm = LLM(model_dir, dtype="bfloat16", device="cuda", max_num_seqs=max(args.batches),
                  max_num_batched_tokens=max(args.prefill + [2048]), max_model_len=max(args.prefill + [2048]) + 64,
                  kv_cache_memory_fraction=0.25, enable_prefix_caching=False)
    mc = llm.engine.cfg.model
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.model.parameters())
    print(f"{args.shape}: {weight_bytes / 2 / 1e9:.2f}B params, engine ready in {time.perf_counter() - t0:.1f}s, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    hf = None if args.no_hf else hf_twin(llm.engine.model, model_dir)
    res = dict(shape=args.shape, params=weight_bytes // 2, copy_bw_TBps=bw / 1e12, device=torch.cuda.get_device_name(),
               torch=torch.__version__, command=" ".join(sys.argv))
    args.out.mkdir(parents=True, exist_ok=True)
    out_json = args.out / f"e2e-{args.shape}.json"
    emb = llm.engine.model.backbone.embeddings.weight
    embed_bytes = 0 if mc.tie_word_embeddings else emb.numel() * emb.element_size()
    res["decode"] = bench_decode(llm, hf, mc, args.batches, args.prompt_len, args.gen, bw, weight_bytes,
                                 args.hf_batches, args.hf_gen, rng, embed_bytes)
    save_json(out_json, res)                      # partial results survive a time-out
    res["prefill"] = bench_prefill(llm, mc, args.prefill, rng)
    save_json(out_json, res)
    del llm, hf
    gc.collect()
    torch.cuda.empty_cache()
    if args.spec_batches:
        draft_dir = write_config(tmp / "draft", {**SHAPE_SMALL, "vocab_size": mc.vocab_size})
        res["spec"] = bench_spec(model_dir, draft_dir, mc, args.spec_batches, args.gen, rng)
    save_json(out_json, res)
    print("\n| batch | ours tok/s | step ms | HF tok/s | x HF | roofline tok/s | % roofline | strict roofline tok/s | % strict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in res["decode"]:
        print(f"| {r['batch']} | {r['ours_tok_s']:.1f} | {r['step_ms']:.2f} | {r.get('hf_tok_s') or float('nan'):.1f} "
              f"| {r.get('speedup_vs_hf', float('nan')):.1f} | {r['roofline_tok_s']:.1f} | {100 * r['frac_roofline']:.0f}% "
              f"| {r['roofline_strict_tok_s']:.1f} | {100 * r['frac_roofline_strict']:.0f}% |")
    for r in res["prefill"]:
        print(f"prefill {r['prompt_len']}: {r['ours_tok_s']:.0f} tok/s ({r['ms']:.1f} ms)")
    for r in res.get("spec", []):
        print(f"spec {r['method']:<12} B={r['batch']:<3} {r['tok_s']:8.1f} tok/s  x{r['speedup']:.2f} "
              f"(target x{r['target_speedup']:.2f})  acc.len {r['acceptance_length']:.2f}  step {r['step_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
