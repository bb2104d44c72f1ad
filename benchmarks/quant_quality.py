"""Quality of the quantized formats on a trained model (issue 17): held-out loss and greedy agreement.

The embedded default target (trained on Python source and docs by ``benchmarks/train``) is run
unquantized and in each format, all computing in bfloat16 on the held-out files of the training
corpus (never trained on: the same split by file hash, ``benchmarks/train/corpus.py``):

- ``bf16``: the checkpoint's weights rounded to bfloat16 (the baseline the goals compare with);
- ``fp8``: a ModelOpt-layout FP8 folder written by ``hybrid_engine.quantize`` (per-tensor weight
  scales, lm_head excluded, as published);
- ``fp8-online``: ``LLM(quantization="fp8")`` on the bf16 checkpoint (per-channel scales);
- ``nvfp4``: an NVFP4 folder by ``hybrid_engine.quantize`` (16-value blocks with FP8 scales and a
  per-tensor second scale, lm_head excluded);
- ``float32``: the checkpoint as trained, for scale.

Per variant: next-token cross-entropy over the held-out windows (every position), its ratio to
bf16, and greedy agreement with bf16 on held-out prompts (tokens equal before the first
difference, and prompts whose continuation is identical). Goals: FP8 within 1% of bf16's loss,
NVFP4 within 5%. Runs on the CPU (the reference kernels dequantize exactly); on CUDA the
quantized kernels run instead.

    python benchmarks/quant_quality.py                    # CPU, ~1 minute
    python benchmarks/quant_quality.py --windows 32 --seq-len 512 --out benchmarks/results/X
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("float32", "bf16", "fp8", "fp8-online", "nvfp4")


def heldout_windows(tokenizer, seq_len: int, n: int, heldout_bytes: int = 400_000) -> list[list[int]]:
    """``n`` windows of ``seq_len + 1`` tokens from the held-out .py files, one file after another."""
    from benchmarks.train.corpus import build_corpus
    corpus = build_corpus(max_bytes=1, max_heldout_bytes=heldout_bytes, docs_frac=0.0)
    stream: list[int] = []
    for f in corpus.heldout:
        stream += tokenizer.encode(f.text, add_special_tokens=False)
        if len(stream) >= n * (seq_len + 1):
            break
    w = seq_len + 1
    if len(stream) < w:
        raise ValueError(f"the held-out files gave {len(stream)} tokens, fewer than one window of {w}")
    return [stream[i * w:(i + 1) * w] for i in range(min(n, len(stream) // w))]


def variant_llm(variant: str, src: Path, work: Path, seq_len: int, device: str):
    """An ``LLM`` of ``variant`` sized for one window at a time (quantized folders written into
    ``work`` on first use)."""
    from hybrid_engine import LLM
    from hybrid_engine.quantize import quantize_folder
    model, kw = src, {}
    if variant in ("fp8", "nvfp4"):
        model = work / variant
        if not (model / "config.json").exists():
            quantize_folder(src, model, variant)
    elif variant == "fp8-online":
        kw["quantization"] = "fp8"
    block = 16
    return LLM(str(model), device=device, dtype="float32" if variant == "float32" else "bfloat16",
               max_num_seqs=8, block_size=block, num_kv_blocks=8 * math.ceil((seq_len + 64) / block) + 8,
               max_model_len=seq_len + 64, async_scheduling=False, enable_prefix_caching=False, **kw)


@torch.no_grad()
def heldout_loss(llm, windows: list[list[int]]) -> float:
    """Mean next-token cross-entropy (float32 logits) over every position of the windows."""
    from hybrid_engine.evaluation import prefill_hidden
    model = llm.engine.model
    total, count = 0.0, 0
    with torch.inference_mode():
        for w in windows:
            logits = model.compute_logits(prefill_hidden(llm, w[:-1])).float()
            labels = torch.tensor(w[1:], device=logits.device)
            total += F.cross_entropy(logits, labels, reduction="sum").item()
            count += labels.numel()
    return total / count


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from hybrid_engine import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def agreement(ours: list[list[int]], base: list[list[int]]) -> dict:
    """Mean fraction of tokens equal to the baseline's before the first difference; share of
    prompts whose whole continuation is identical."""
    prefix = []
    for a, b in zip(ours, base):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        prefix.append(n / len(b))
    return {"prefix_agreement": sum(prefix) / len(prefix),
            "identical": sum(a == b for a, b in zip(ours, base)) / len(base)}


def measure(variants=VARIANTS, *, windows: int = 16, seq_len: int = 256, prompts: int = 8, prompt_len: int = 64,
            max_tokens: int = 32, device: str = "cpu", work: Path | None = None) -> dict:
    from hybrid_engine.default_model import default_model_dir
    from hybrid_engine.prompt_inputs import load_tokenizer
    src = default_model_dir()
    tok = load_tokenizer(src)
    wins = heldout_windows(tok, seq_len, windows)
    prompt_ids = [w[:prompt_len] for w in wins[:prompts]]
    own = work is None
    work = Path(tempfile.mkdtemp(prefix="quant_quality_")) if own else Path(work)
    rows = {}
    for v in variants:
        t0 = time.perf_counter()
        llm = variant_llm(v, src, work, seq_len, device)
        rows[v] = {"loss": heldout_loss(llm, wins), "greedy": greedy(llm, prompt_ids, max_tokens),
                   "seconds": time.perf_counter() - t0}
        llm.shutdown()
        del llm
    base = rows.get("bf16")
    for v, r in rows.items():
        if base is not None:
            r["loss_ratio"] = r["loss"] / base["loss"]
            r.update(agreement(r["greedy"], base["greedy"]))
    return {"model": str(src), "device": device, "windows": len(wins), "seq_len": seq_len,
            "scored_tokens": len(wins) * seq_len, "prompts": len(prompt_ids), "prompt_len": prompt_len,
            "max_tokens": max_tokens, "torch": torch.__version__, "variants": rows}


GOALS = {"fp8": 1.01, "fp8-online": 1.01, "nvfp4": 1.05}      # loss ratio to bf16, at most


def report(res: dict) -> str:
    lines = [f"held-out windows {res['windows']} x {res['seq_len']} tokens ({res['scored_tokens']} scored), "
             f"greedy agreement on {res['prompts']} prompts x {res['max_tokens']} tokens, {res['device']}",
             "", "| variant | held-out loss | vs bf16 | goal | greedy prefix agreement | identical |",
             "|---|---|---|---|---|---|"]
    for v, r in res["variants"].items():
        goal = GOALS.get(v)
        ok = "" if goal is None else (f"<= {goal:.2f}x: " + ("met" if r["loss_ratio"] <= goal else "MISSED"))
        lines.append(f"| {v} | {r['loss']:.4f} | {r.get('loss_ratio', float('nan')):.4f}x | {ok} | "
                     f"{r.get('prefix_agreement', float('nan')):.3f} | {r.get('identical', float('nan')):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    res = measure(windows=args.windows, seq_len=args.seq_len, prompts=args.prompts, max_tokens=args.max_tokens,
                  device=args.device)
    text = report(res)
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(res, indent=1))
        Path(args.out + ".md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
