"""Prefill attention after a long cached context (issue 19): one request's chunk of T query tokens
after C context tokens, the 8B shape's heads (32 query / 8 KV heads of 128), bf16, paged blocks of
16. Times ``triton_paged_attention`` over tile configurations and key-range splits, beside the
automatic choice, by ``graph_ms`` (launches captured in a CUDA graph, as the prefill graphs run
them). Each configuration is checked against the automatic one first.

    python benchmarks/attn_prefill_sweep.py [--cases 304:2048 64:2048 ...] [--json f.json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import graph_ms  # noqa: E402
from hybrid_engine.attention.triton_attention import triton_paged_attention  # noqa: E402


def case(T: int, C: int, nH=32, nkv=8, hd=128, bs=16, max_model_len=8192):
    g = torch.Generator(device="cuda").manual_seed(0)
    S = T + C
    nblk = -(-S // bs)
    NB = nblk + 8
    q = torch.randn(T, nH, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    kc = torch.randn(NB, bs, nkv, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(NB, bs, nkv, hd, device="cuda", dtype=torch.bfloat16, generator=g)
    bt = torch.zeros(1, max_model_len // bs, dtype=torch.int32, device="cuda")
    bt[0, :nblk] = torch.randperm(NB - 1, device="cuda", generator=g)[:nblk].to(torch.int32) + 1
    qsl = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    sl = torch.tensor([S], dtype=torch.int32, device="cuda")
    return (q, kc, vc, qsl, sl, bt, hd ** -0.5), S


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="*", default=["304:2048", "112:2048", "304:4096", "2352:0"])
    ap.add_argument("--max-model-len", type=int, default=8192, help="the bound the prefill graphs pass as max_seq_len")
    ap.add_argument("--quick", action="store_true",
                    help="only the automatic choice and the earlier 64 x 64 tiles without splits")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = []
    for spec in args.cases:
        T, C = map(int, spec.split(":"))
        a, S = case(T, C, max_model_len=max(args.max_model_len, T + C))
        ref = triton_paged_attention(*a, T, S).float()
        rows = []
        for label, sm, kw in ([("auto, exact bound", S, {}), ("auto, graph bound", args.max_model_len, {})]
                              + [(f"q{bq} n{bn} w{nw} s{st} x{sp}", S,
                                  dict(block_q=bq, block_n=bn, num_warps=nw, num_splits=sp,
                                       **({} if st is None else {"num_stages": st})))
                                 for bq, bn, nw, st, sp in itertools.product(
                                     (16, 32), (32, 64, 128), (4, 8), (None, 3), (1, 2, 3, 4, 6, 8))
                                 if not args.quick or (bq, bn, nw, st, sp) == (16, 64, 4, None, 1)]):
            try:
                o = triton_paged_attention(*a, T, sm, **kw)
                err = float((o.float() - ref).abs().max())
                ms = graph_ms([lambda: triton_paged_attention(*a, T, sm, **kw)], reps=20, replays=5)
            except Exception as e:          # a config that does not compile (registers, shared memory)
                print(f"T={T} C={C} {label}: failed {type(e).__name__}", flush=True)
                continue
            rows.append(dict(label=label, us=1e3 * ms, err=err))
        rows.sort(key=lambda r: r["us"])
        auto = [r for r in rows if r["label"].startswith("auto")]
        print(f"T={T} C={C}: " + "; ".join(f"{r['label']} {r['us']:.1f} us" for r in auto))
        for r in rows[:8]:
            print(f"   {r['label']:24s} {r['us']:8.1f} us  err {r['err']:.2e}")
        out.append(dict(T=T, C=C, rows=rows))
    if args.json:
        Path(args.json).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), cases=out), indent=1))


if __name__ == "__main__":
    main()
