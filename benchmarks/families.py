"""Decode and prefill throughput of the other Mamba2 hybrid families (Bamba, Granite-4.0-H,
Falcon-H1) next to Nemotron-H at one comparable shape, on random weights (transformers' own
classes, ``make_family_model`` / ``make_hf_model``): where a family's extra work (RoPE as torch
ops, Granite's softmax router and SwiGLU experts, Falcon-H1's parallel attention and multipliers)
costs time. Median of 3 timed runs after a warm-up; decode step time = the median interval
between consecutive decode-only step launches (``benchmarks.common.StepClock``).

    python benchmarks/families.py --out $OUT                           # CUDA, bf16, ~1B-class widths
    python benchmarks/families.py --device cpu --tiny --out /tmp/fam   # CPU smoke test of the script

Writes ``families.json`` to --out and prints a table.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import median_time, save_json, step_clock  # noqa: E402
from hybrid_engine import LLM, SamplingParams  # noqa: E402
from hybrid_engine.models.synthetic import make_family_model, make_hf_model  # noqa: E402

# 12 layers, hidden 1024, 16 heads (4 KV) of 64, Mamba 32 heads of 64 (state 128, 1 group), 3 attention layers
WIDE = dict(vocab_size=32000, hidden_size=1024, heads=16, kv=4, head_dim=64, mamba_heads=32, state=128, inter=2816,
            layers=12, attn=(3, 7, 11), experts=32, top_k=4, expert_inter=512, shared=1024, chunk=128)
TINY = dict(vocab_size=256, hidden_size=64, heads=4, kv=2, head_dim=16, mamba_heads=8, state=16, inter=128,
            layers=4, attn=(1, 3), experts=4, top_k=2, expert_inter=32, shared=64, chunk=16)


def build(family: str, s: dict, out: Path) -> Path:
    n, attn = s["layers"], s["attn"]
    mamba = dict(mamba_n_heads=s["mamba_heads"], mamba_d_head=s["hidden_size"] * 2 // s["mamba_heads"],
                 mamba_n_groups=1, mamba_d_state=s["state"], mamba_chunk_size=s["chunk"])
    common = dict(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"], num_hidden_layers=n,
                  num_attention_heads=s["heads"], num_key_value_heads=s["kv"])
    if family == "nemotron_h":
        pattern = "".join("*" if i in attn else "M" for i in range(n))
        pattern = "".join(c + "-" for c in pattern)                      # each mixer then an MLP
        return make_hf_model(out, pattern, vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                             num_attention_heads=s["heads"], num_key_value_heads=s["kv"], head_dim=s["head_dim"],
                             intermediate_size=s["inter"], mamba_num_heads=s["mamba_heads"],
                             mamba_head_dim=s["hidden_size"] * 2 // s["mamba_heads"], n_groups=1,
                             ssm_state_size=s["state"], chunk_size=s["chunk"])
    if family == "bamba":
        return make_family_model(out, "bamba", intermediate_size=s["inter"], attn_layer_indices=list(attn),
                                 **common, **mamba)
    if family == "granitemoehybrid":
        return make_family_model(out, "granitemoehybrid", intermediate_size=s["expert_inter"],
                                 shared_intermediate_size=s["shared"], num_local_experts=s["experts"],
                                 num_experts_per_tok=s["top_k"], position_embedding_type="nope",
                                 layer_types=["attention" if i in attn else "mamba" for i in range(n)],
                                 embedding_multiplier=12.0, residual_multiplier=0.22,
                                 attention_multiplier=0.0156, logits_scaling=6.0, **common, **mamba)
    if family == "falcon_h1":
        m = dict(mamba, mamba_d_ssm=s["hidden_size"] * 2)
        return make_family_model(out, "falcon_h1", intermediate_size=s["inter"], head_dim=s["head_dim"],
                                 num_hidden_layers=max(1, n // 2), **{k: v for k, v in common.items()
                                                                      if k != "num_hidden_layers"}, **m)
    raise ValueError(family)


def timed(fn, device) -> float:
    return median_time(fn, sync=torch.cuda.synchronize if device == "cuda" else None)


def bench(model_dir: Path, device: str, dtype: str, batches, prompt_len: int, gen: int, rng) -> list[dict]:
    llm = LLM(str(model_dir), dtype=dtype, device=device, max_num_seqs=max(batches), max_num_batched_tokens=4096,
              enable_prefix_caching=False)
    vocab = llm.engine.cfg.model.vocab_size
    rows = []
    for b in batches:
        prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(b)]
        run = lambda n: llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)  # noqa: E731
        t_pre = timed(lambda: run(1), device)
        step = step_clock(llm).step_time(lambda: run(gen))
        rows.append(dict(batch=b, decode_tok_s=b / step, step_ms=step * 1e3, prefill_tok_s=b * prompt_len / t_pre))
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke test of the script)")
    ap.add_argument("--batches", default="1,32", help="comma-separated decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--gen", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--out", default=".", help="folder for families.json")
    args = ap.parse_args(argv)
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    shape = TINY if args.tiny else WIDE
    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "dtype": dtype,
               "shape": {k: list(v) if isinstance(v, tuple) else v for k, v in shape.items()}, "families": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("nemotron_h", "bamba", "granitemoehybrid", "falcon_h1"):
            d = build(family, shape, Path(tmp) / family)
            results["families"][family] = bench(d, args.device, dtype, batches, args.prompt_len, args.gen, rng)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_json(out / "families.json", results)
    print(f"{'family':18s} {'batch':>5s} {'decode tok/s':>13s} {'step ms':>8s} {'prefill tok/s':>14s}")
    for family, rows in results["families"].items():
        for r in rows:
            print(f"{family:18s} {r['batch']:5d} {r['decode_tok_s']:13.1f} {r['step_ms']:8.2f} {r['prefill_tok_s']:14.1f}")


if __name__ == "__main__":
    main()
