"""Gated RMSNorm launch configs at decode sizes, beside a copy of the same bytes (CUDA).

At T = 64..256 tokens the norm moves 3-12 MB, so a fixed per-launch cost is a large part of its
time; the same-size copy (graph-timed like the kernel, rotated buffers) shows what the memory
system gives a single kernel of that size, next to the 1 GiB copy bandwidth of ``kernels.py``.

    python benchmarks/norm_sweep.py --out $OUT/norm_sweep.md
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kernels import DEV, I, bench, copy_bandwidth, mk_norm, nsets_for  # noqa: E402

CONFIGS = ([dict()] + [dict(block_t=bt, num_warps=nw) for bt in (1, 2, 4) for nw in (1, 2, 4, 8)]
           + [dict(streaming=True), dict(block_t=1, num_warps=8, streaming=True),
              dict(block_t=4, num_warps=4, streaming=True)])


def copy_ms(nbytes: int) -> float:
    """Graph-timed ms of one device copy that reads nbytes / 2 and writes nbytes / 2."""
    half = nbytes // 2
    sets = [(torch.empty(half, dtype=torch.uint8, device=DEV).random_(),
             torch.empty(half, dtype=torch.uint8, device=DEV)) for _ in range(nsets_for(nbytes))]
    return bench([lambda a=a: a[1].copy_(a[0]) for a in sets])[0]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="32,64,128,256")
    ap.add_argument("--quick", action="store_true", help="the default and the streaming configs only")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from hybrid_engine.mamba_cache.ops.triton_norm import triton_gated_rmsnorm
    bw = copy_bandwidth()
    lines = [f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, intermediate {I}, "
             f"bf16, 1 GiB copy {bw:.0f} GB/s", "",
             "| T | config | ms | GB/s | % of 1 GiB copy BW | same-bytes copy ms | % of same-bytes copy |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for T in (int(t) for t in args.tokens.split(",")):
        nbytes = T * I * 2 * 3
        cms = copy_ms(nbytes)
        for cfg in ([c for c in CONFIGS if not c or "streaming" in c] if args.quick else CONFIGS):
            _, calls, nb = mk_norm(T, lambda *a, cfg=cfg, **k: triton_gated_rmsnorm(*a, **cfg, **k))
            ms = bench(calls)[0]
            gbs = nb / (ms * 1e-3) / 1e9
            lines.append(f"| {T} | {cfg or 'default'} | {ms:.4f} | {gbs:.0f} | {100 * gbs / bw:.0f}% | "
                         f"{cms:.4f} | {100 * cms / ms:.0f}% |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
