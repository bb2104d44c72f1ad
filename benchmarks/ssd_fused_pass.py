"""Steps 2 and 3 of the SSD scan fused (``triton_ssd_fused_pass``) against the two kernels: the
pooled scan of one Mamba layer of the 8B shape (128 heads x 64, state 128, 8 groups, chunks of 128 tokens, bf16): GPU us per call from a
CUDA graph of repeated calls (median of replays), per variant of the scan's options.

    python benchmarks/ssd_fused_pass.py                  # lengths: fused vs unfused; options at 304
    python benchmarks/ssd_fused_pass.py --lens 2348 --sweep-tokens 4096 8192 --no-options
    python benchmarks/ssd_fused_pass.py --profile --out DIR     # + per-kernel us
    python benchmarks/ssd_fused_pass.py --shape nano --lens 8192 --no-options   # 64 heads (not yet measured)
    python benchmarks/ssd_fused_pass.py --lens 8192 --emit-every 1024 --no-options  # many emits a sequence

Rows:
- ``--lens``: the sequences of one call (default: one of 304 tokens, the cached request of
  ``ttft_profile.py``: 300 new tokens after a 2048-token restore, padded to 304); each starts from a
  restored state (pool slot, has_initial_state) and emits the state after its last full 16-token
  block into a checkpoint row, as a prefill that saves a chat turn's end does.
- sweep of sequence lengths and batches: the fused steps 2+3 (the emits by the emit kernel,
  ``fused_emits=False``) against the two kernels;
- a third column: the fused pass storing the emits itself (``fused_emits``, the default: no emit
  kernel, no float32 copy of the entry states);
- option sweep at the first length: the fused kernel's block_p / block_k / warps and the chunk
  output's heads per program / rows per program.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import graph_ms  # noqa: E402
from benchmarks.profiling import kernel_times  # noqa: E402
from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen_pooled  # noqa: E402

P, N, CS = 64, 128, 128
SHAPES = {"8b": (128, 8), "nano": (64, 8)}          # (Mamba heads, groups); head_dim 64, state 128


def make_case(lens, H=128, G=8, dtype=torch.bfloat16, seed=0, emit_every=0):
    """Inputs shaped as the mixer passes them: x / B / C strided views of one conv output, dt a
    view of the in_proj output; a pool of len(lens)+2 slots whose rows start from random states."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    I, CONV = H * P, H * P + 2 * G * N
    T = sum(lens)
    dev = "cuda"
    xbc = torch.randn(T, CONV, generator=g, device=dev).to(dtype)
    zxbcdt = torch.randn(T, I + CONV + H, generator=g, device=dev).to(dtype)
    x, B, C = xbc.split([I, G * N, G * N], dim=-1)
    dt = zxbcdt[:, I + CONV:]
    dt_bias = torch.randn(H, generator=g, device=dev) * 0.5
    A = -torch.rand(H, generator=g, device=dev) - 0.1
    D = torch.randn(H, generator=g, device=dev)
    Bn = len(lens)
    pool = torch.randn(Bn + 2, H, P, N, generator=g, device=dev)
    slots = torch.arange(1, Bn + 1, device=dev)
    has_init = torch.ones(Bn, dtype=torch.bool, device=dev)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    at = []
    for s, L in zip(qsl[:-1].tolist(), lens):     # every emit_every tokens, then the last full block
        at += [s + q - 1 for q in range(emit_every, L, emit_every)] if emit_every else []
        at.append(s + max(L // 16 * 16, 1) - 1)
    emit = torch.tensor(at, dtype=torch.int64, device=dev)
    ckpt = torch.zeros(len(at) + 1, H, P, N, device=dev)
    rows = torch.arange(len(at), device=dev)
    args = (x.reshape(T, H, P), dt, dt_bias, A, B.reshape(T, G, N), C.reshape(T, G, N), D, qsl, pool, slots,
            has_init, CS)
    # the emits are sorted by construction, as the engine's saves are (the mixer says so too)
    return args, dict(max_seqlen=max(lens), out_dtype=dtype, emit_at=emit, emit_out=ckpt, emit_rows=rows,
                      emits_sorted=True)


def time_variant(args, kw, opts, reps=10):
    call = lambda: triton_ssd_scan_varlen_pooled(*args, **kw, **opts)      # noqa: E731
    call()
    torch.cuda.synchronize()
    return graph_ms([call], reps=reps) * 1e3


def profile_variant(args, kw, opts, n=20):
    from torch.profiler import ProfilerActivity, profile
    call = lambda: triton_ssd_scan_varlen_pooled(*args, **kw, **opts)      # noqa: E731
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    return [(name, count // n, ms * 1e3 / n) for name, count, ms in kernel_times(prof, 60)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", type=int, nargs="+", default=[304])
    ap.add_argument("--sweep-tokens", type=int, nargs="*", default=[128, 256, 384, 512, 640, 768, 1024, 2348])
    ap.add_argument("--batches", default="8x300,32x200", help="extra batches for the fused/unfused rows: BxL,...")
    ap.add_argument("--no-options", action="store_true", help="skip the option sweep")
    ap.add_argument("--profile", action="store_true", help="per-kernel us of the default and unfused calls")
    ap.add_argument("--emit-every", type=int, default=0,
                    help="also emit every N tokens of each sequence (a prefill crossing checkpoint boundaries)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b",
                    help="Mamba heads and groups: 8b (128, 8) or nano (64, 8)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    H, G = SHAPES[a.shape]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {a.shape} "
          f"({H} heads, {G} groups)")
    res = {"shape": a.shape, "lens": a.lens, "rows": [], "options": [], "profile": {}}
    cases = [[L] for L in a.sweep_tokens] + [[int(L)] * int(b) for b, L in
                                             (s.split("x") for s in a.batches.split(",") if s)]
    cases = [list(a.lens)] + [c for c in cases if c != list(a.lens)]
    print(f"{'batch':>12} {'unfused us':>11} {'fused us':>9} {'ratio':>6} {'+emits us':>9}")
    for lens in cases:
        args, kw = make_case(lens, H, G, emit_every=a.emit_every)
        t_old = time_variant(args, kw, dict(fused_pass=False))
        t_new = time_variant(args, kw, dict(fused_pass=True, fused_emits=False))
        t_emit = time_variant(args, kw, dict(fused_pass=True, fused_emits=True))
        label = f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
        print(f"{label:>12} {t_old:11.1f} {t_new:9.1f} {t_old / t_new:6.2f} {t_emit:9.1f}", flush=True)
        res["rows"].append(dict(batch=label, unfused_us=t_old, fused_us=t_new, fused_emits_us=t_emit))
    args, kw = make_case(list(a.lens), H, G, emit_every=a.emit_every)
    if not a.no_options:
        variants = [dict(fused_pass=False), dict()]
        variants += [dict(fused_pass=True, fused_block_p=bp, fused_block_k=bk, fused_num_warps=w)
                     for bp in (16, 32, 64) for bk in (32, 64) for w in (4, 8)]
        variants += [dict(heads_per_program=hpp, block_m=bm) for hpp in (1, 2, 4) for bm in (32, 64)]
        variants += [dict(heads_per_program=2, block_m=64, num_warps=8), dict(heads_per_program=4, num_warps=8),
                     dict(num_stages=1), dict(num_stages=3)]
        variants.append(dict())          # the default again last: drift within the run
        for v in variants:
            t = time_variant(args, kw, v)
            print(f"  {json.dumps(v):90s} {t:7.1f} us", flush=True)
            res["options"].append(dict(options=v, us=t))
    if a.profile:
        for name, opts in (("default", {}), ("unfused", dict(fused_pass=False)),
                           ("fused, emits inside", dict(fused_pass=True, fused_emits=True))):
            rows = profile_variant(args, kw, opts)
            print(f"per-kernel us, {name}:")
            for k, c, us in rows:
                print(f"  {us:7.2f} us {c:3d}x {k}")
            res["profile"][name] = rows
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "ssd_fused_pass.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
