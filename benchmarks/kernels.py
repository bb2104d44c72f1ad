"""Triton kernels vs their torch references on Nemotron-H-8B shapes (CUDA only).

Mamba mixer: 128 heads x 64 head_dim, 8 groups, d_state 128, conv width 4, conv_dim 10240,
intermediate 8192 (norm group 1024); attention: 32 heads, 8 kv heads, head_dim 128, block 16.
Decode / verify: batch 1..256, s = 1 (K = 0) and s = 4 (K = 3).  Prefill: 2k and 8k tokens.

Timing: each op is warmed up, then `reps` calls are captured in one CUDA graph (so the numbers are
GPU time, without Python launch overhead; the engine replays decode steps as graphs too) and the
graph is replayed `replays` times between torch.cuda.Event pairs; the median per call is reported.
Where a working set would sit in L2 (50 MB), the calls rotate over several disjoint sets of pool
slots / inputs.  "eager" = the same calls launched one by one (events around a loop).
Bandwidth = minimum bytes (every input read once, every output written once) / time, shown next
to a device-to-device copy measured in the same run (bytes read + written).

    python benchmarks/kernels.py [--quick] [--out results.md] [--json results.json] [--sweep]
    python benchmarks/kernels.py --sweep-conv [--conv-variants-only]   (conv-update variants)
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import copy_bandwidth, event_ms, graph_ms  # noqa: E402
from benchmarks.kernels_ssu_gated import mk_ssu_gated  # noqa: E402
from hybrid_engine.attention.ops import paged_attention_ref  # noqa: E402
from hybrid_engine.mamba_cache.ops import (causal_conv1d_update_ref, causal_conv1d_varlen_ref,  # noqa: E402
                             gated_rmsnorm_ref, selective_state_update_ref, ssd_scan_varlen_ref)

H, P, G, NST, W = 128, 64, 8, 128, 4
I = H * P
CONV = I + 2 * G * NST
NH, NKV, HD, BS = 32, 8, 128, 16
DT = torch.bfloat16
DEV = "cuda"
L2_ROTATE_BYTES = 256 << 20


ev_time = event_ms


def bench(calls, reps=None, replays=10, use_graph=True):
    """calls: zero-arg callables (rotation sets).  -> (graph ms/call, eager ms/call)."""
    reps = reps or max(len(calls), 20)
    for c in calls:                                   # warm-up (compiles), twice
        c()
        c()
    torch.cuda.synchronize()
    i = [0]

    def step():
        calls[i[0] % len(calls)]()
        i[0] += 1
    eager = statistics.median(ev_time(step, reps) for _ in range(3))
    if not use_graph:
        return eager, eager
    try:
        return graph_ms(calls, reps, replays), eager
    except Exception as exc:  # pragma: no cover - reported, then eager numbers are used
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; eager timing)", flush=True)
        torch.cuda.synchronize()
        return eager, eager


def nsets_for(bytes_per_set):
    return max(1, min(8, math.ceil(L2_ROTATE_BYTES / max(bytes_per_set, 1))))


def rnd(*shape, dtype=DT, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


# ----------------------------------------------------------------------------- op builders
# each returns (ref_calls, triton_calls, bytes, label)

def mk_ssu(B, s, impl):
    K = s - 1
    slot_bytes = (1 + K) * H * P * NST * 4
    ns = nsets_for(B * slot_bytes)
    pool = torch.randn(B * ns + 1, 1 + K, H, P, NST, device=DEV)
    dt_bias, A, D = rnd(H, dtype=torch.float32) - 2, -torch.rand(H, device=DEV) - 0.5, rnd(H)
    sets = []
    for k in range(ns):
        x, dt = rnd(B, s, H, P), rnd(B, s, H, scale=0.5)
        Bm, Cm = rnd(B, s, G, NST), rnd(B, s, G, NST)
        slots = torch.arange(1 + k * B, 1 + (k + 1) * B, device=DEV, dtype=torch.int32)
        acc = torch.randint(1, s + 1, (B,), device=DEV, dtype=torch.int32)
        sets.append((x, dt, Bm, Cm, slots, acc))

    def calls(fn):       # y in the model dtype, as the model asks for it
        return [lambda a=a: fn(pool, a[0], a[1], dt_bias, A, a[2], a[3], D, a[4], a[5],
                               out_dtype=DT) for a in sets]
    nbytes = B * (H * P * NST * 4 * (1 + s)                       # read 1 checkpoint, write s
                  + s * (H * P * 2 + H * 2 + 2 * G * NST * 2)      # x, dt, B, C (bf16)
                  + s * H * P * 2)                                 # y bf16
    return calls(selective_state_update_ref), calls(impl), nbytes


def mk_conv_update(B, s, impl, token_major=True):
    K = s - 1
    ncols = W - 1 + K
    ns = nsets_for(B * CONV * ncols * 2 + B * s * CONV * 4)
    # MambaPool's layout: token-major storage seen as [S, C, ncols]
    pool = (rnd(B * ns + 1, ncols, CONV).transpose(1, 2) if token_major
            else rnd(B * ns + 1, CONV, ncols))
    w, b = rnd(CONV, W, scale=0.5), rnd(CONV)
    sets = []
    for k in range(ns):
        x = rnd(B, s, CONV)
        slots = torch.arange(1 + k * B, 1 + (k + 1) * B, device=DEV, dtype=torch.int32)
        acc = torch.randint(1, s + 1, (B,), device=DEV, dtype=torch.int32)
        sets.append((x, slots, acc))

    def calls(fn):
        return [lambda a=a: fn(a[0], w, b, pool, a[1], a[2]) for a in sets]
    nbytes = B * CONV * 2 * ((W - 1) + s + s + (W - 2 + s))          # window, x, out, new window
    return calls(causal_conv1d_update_ref), calls(impl), nbytes


def mk_norm(T, impl):
    ns = nsets_for(T * I * 2 * 3)
    sets = [(rnd(T, I), rnd(T, I)) for _ in range(ns)]
    w = rnd(I)

    def calls(fn):
        return [lambda a=a: fn(a[0], a[1], w, I // G, 1e-5) for a in sets]
    return calls(gated_rmsnorm_ref), calls(impl), T * I * 2 * 3


def mk_attn_decode(B, s, impl, ctx=2048, kv_fp8=False):
    seq = ctx + s
    nblk = -(-seq // BS)
    kv_dt = torch.float8_e4m3fn if kv_fp8 else DT         # FP8: codes and per-layer scales
    kv_bytes = B * seq * NKV * HD * 2 * kv_dt.itemsize
    ns = nsets_for(kv_bytes)
    NB = B * ns * nblk + 1
    kc, vc = rnd(NB, BS, NKV, HD, scale=100 if kv_fp8 else 1).to(kv_dt), rnd(NB, BS, NKV, HD).to(kv_dt)
    sc = dict(k_scale=torch.tensor(0.01, device=DEV), v_scale=torch.tensor(0.02, device=DEV)) if kv_fp8 else {}
    sets = []
    for k in range(ns):
        q = rnd(B * s, NH, HD)
        bt = 1 + k * B * nblk + torch.arange(B * nblk, device=DEV, dtype=torch.int32)
        bt = bt.view(B, nblk)
        qsl = torch.arange(0, B * s + 1, s, device=DEV, dtype=torch.int32)
        sl = torch.full((B,), seq, device=DEV, dtype=torch.int32)
        sets.append((q, qsl, sl, bt))

    def calls(fn):
        return [lambda a=a: fn(a[0], kc, vc, a[1], a[2], a[3], HD ** -0.5, s, seq, **sc) for a in sets]
    nbytes = kv_bytes + 2 * B * s * NH * HD * 2
    return calls(paged_attention_ref), calls(impl), nbytes


def mk_attn_prefill(nseq, L, impl):
    nblk = -(-L // BS)
    NB = nseq * nblk + 1
    kc, vc = rnd(NB, BS, NKV, HD), rnd(NB, BS, NKV, HD)
    q = rnd(nseq * L, NH, HD)
    bt = (1 + torch.arange(nseq * nblk, device=DEV, dtype=torch.int32)).view(nseq, nblk)
    qsl = torch.arange(0, nseq * L + 1, L, device=DEV, dtype=torch.int32)
    sl = torch.full((nseq,), L, device=DEV, dtype=torch.int32)

    def calls(fn):
        return [lambda: fn(q, kc, vc, qsl, sl, bt, HD ** -0.5, L, L)]
    nbytes = nseq * L * NKV * HD * 2 * 2 + 2 * nseq * L * NH * HD * 2
    return calls(paged_attention_ref), calls(impl), nbytes


def mk_conv_varlen(T, impl):
    x = rnd(T, CONV)
    w, b = rnd(CONV, W, scale=0.5), rnd(CONV)
    pool = rnd(4, W - 1, CONV).transpose(1, 2)                    # MambaPool's layout
    qsl = torch.tensor([0, T], device=DEV, dtype=torch.int32)
    slots = torch.tensor([1], device=DEV, dtype=torch.int32)
    init = torch.ones(1, device=DEV, dtype=torch.bool)

    def calls(fn):
        return [lambda: fn(x, w, b, pool, qsl, slots, init)]
    return calls(causal_conv1d_varlen_ref), calls(impl), 2 * T * CONV * 2


def mk_ssd(T, impl, cs=128, **kw):
    x, dt = rnd(T, H, P), rnd(T, H, scale=0.5)
    Bm, Cm = rnd(T, G, NST), rnd(T, G, NST)
    dt_bias, A, D = rnd(H, dtype=torch.float32) - 2, -torch.rand(H, device=DEV) - 0.5, rnd(H)
    qsl = torch.tensor([0, T], device=DEV, dtype=torch.int32)
    init = torch.randn(1, H, P, NST, device=DEV)

    def calls(fn, **k2):  # y in the model dtype, as the model asks for it
        return [lambda: fn(x, dt, dt_bias, A, Bm, Cm, D, qsl, init, cs, out_dtype=DT, **k2)]
    nbytes = T * (H * P * 2 + H * 2 + 2 * G * NST * 2 + H * P * 2) + 2 * H * P * NST * 4
    return calls(ssd_scan_varlen_ref), calls(impl, **kw), nbytes


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer batch sizes")
    ap.add_argument("--sweep", action="store_true", help="also sweep kernel block configs")
    ap.add_argument("--sweep-only", action="store_true", help="only the config sweeps")
    ap.add_argument("--sweep-conv", action="store_true",
                    help="only the conv-update sweeps: the variants, then the block configs")
    ap.add_argument("--conv-variants-only", action="store_true",
                    help="with --sweep-conv: skip the block-config sweep of the default kernel")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of the prefill ops")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    import triton

    from hybrid_engine.attention.triton_attention import triton_paged_attention
    from hybrid_engine.mamba_cache.ops.triton_conv import triton_causal_conv1d_varlen
    from hybrid_engine.mamba_cache.ops.triton_conv_update import triton_causal_conv1d_update
    from hybrid_engine.mamba_cache.ops.triton_norm import triton_gated_rmsnorm
    from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen
    from hybrid_engine.mamba_cache.ops.triton_ssd_sequential import triton_ssd_scan_sequential
    from hybrid_engine.mamba_cache.ops.triton_state_update import (triton_selective_state_update,
                                                     triton_selective_state_update_gated)

    torch.manual_seed(0)
    prop = torch.cuda.get_device_properties(0)
    head = (f"device: {prop.name} ({prop.multi_processor_count} SMs), torch {torch.__version__}, "
            f"triton {triton.__version__}, dtype bf16, date {time.strftime('%Y-%m-%d')}")
    print(head, flush=True)
    bw = copy_bandwidth() / 1e9                 # GB/s, read + write
    print(f"device-to-device copy: {bw:.0f} GB/s (read + write)", flush=True)

    batches = [1, 8, 64, 256] if args.quick else [1, 8, 32, 64, 128, 256]
    if args.sweep_only:
        args.sweep = True
    if args.sweep_conv:
        args.sweep_only = True     # the conv-update sweep alone
    rows, raw = [], []

    def record(op, shape, mk, *a, reps=None, **kw):
        t0 = time.time()
        ref_calls, tri_calls, nbytes = mk(*a, **kw)
        tk, tk_eager = bench(tri_calls, reps)
        tr = bench(ref_calls, reps)[0]
        gbs = nbytes / (tk * 1e-3) / 1e9
        r = dict(op=op, shape=shape, ref_ms=tr, triton_ms=tk, triton_eager_ms=tk_eager,
                 speedup=tr / tk, gbs=gbs, pct_copy=100 * gbs / bw, mbytes=nbytes / 1e6)
        raw.append(r)
        rows.append(f"| {op} | {shape} | {tr:.4f} | {tk:.4f} | {tr / tk:.1f}x | {gbs:.0f} | "
                    f"{100 * gbs / bw:.0f}% | {tk_eager:.4f} |")
        print(rows[-1], f"({time.time() - t0:.1f}s)", flush=True)
        del ref_calls, tri_calls
        torch.cuda.empty_cache()

    hdr = ["| op | shape | torch ref ms | triton ms | speedup | triton GB/s | % of copy BW | "
           "triton eager ms |", "|---|---|---|---|---|---|---|---|"]
    def main_table():
        print("\n".join(hdr), flush=True)
        for s in (1, 4):
            for B in batches:
                record("selective_state_update", f"B={B} s={s}", mk_ssu, B, s,
                       triton_selective_state_update)
        for s in (1, 4):     # SSU + gated norm in one kernel; ref column: the two kernels
            for B in batches:
                record("ssu_gated (ref = triton SSU + norm)", f"B={B} s={s}", mk_ssu_gated, B, s,
                       triton_selective_state_update_gated, triton_selective_state_update,
                       triton_gated_rmsnorm)
        for s in (1, 4):
            for B in batches:
                record("causal_conv1d_update", f"B={B} s={s}", mk_conv_update, B, s,
                       triton_causal_conv1d_update)
        for s in (1, 4):
            for B in batches:
                record("gated_rmsnorm", f"T={B * s} (B={B} s={s})", mk_norm, B * s,
                       triton_gated_rmsnorm)
        for s in (1, 4):
            for B in batches:
                record("paged_attention decode", f"B={B} s={s} ctx=2048", mk_attn_decode, B, s,
                       triton_paged_attention)
                record("paged_attention decode (FP8 KV)", f"B={B} s={s} ctx=2048", mk_attn_decode, B, s,
                       triton_paged_attention, kv_fp8=True)
        for T in (2048, 8192):
            record("causal_conv1d_varlen", f"1x{T}", mk_conv_varlen, T, triton_causal_conv1d_varlen,
                   reps=5)
            record("ssd_scan_varlen (chunked)", f"1x{T} cs=128", mk_ssd, T, triton_ssd_scan_varlen,
                   reps=5)
            record("ssd_scan_varlen (chunked, lowp=False: TF32 dots)", f"1x{T} cs=128", mk_ssd, T,
                   triton_ssd_scan_varlen, reps=5, lowp=False)
            record("ssd_scan (sequential kernel)", f"1x{T}", mk_ssd, T, triton_ssd_scan_sequential,
                   reps=5)
            record("gated_rmsnorm", f"T={T}", mk_norm, T, triton_gated_rmsnorm, reps=5)
        for nseq in (1, 4):
            record("paged_attention prefill", f"{nseq}x2048", mk_attn_prefill, nseq, 2048,
                   triton_paged_attention, reps=5)

    if not args.sweep_only:
        main_table()

    sweep = []

    def sw(name, mk, *a, reps=None, **cfg):
        _, calls, nb = mk(*a)
        t = bench(calls, reps)[0]
        sweep.append(dict(op=name, args=[str(v) for v in a if not callable(v)], ms=t,
                          pct_copy=100 * nb / (t * 1e-3) / 1e9 / bw, **cfg))
        print(f"{name} {[v for v in a if not callable(v)]} {cfg}: {t:.4f} ms "
              f"({sweep[-1]['pct_copy']:.0f}% copy BW)", flush=True)
        torch.cuda.empty_cache()

    if args.sweep or args.sweep_conv:
        print("\nconfig sweeps (triton ms, graph-timed)", flush=True)
    if args.sweep and not args.sweep_conv:
        for T in (8192, 2048):
            for lowp in (False, True):
                for cb_pre in (False, True):
                    for bm, bk, nw in ((128, 32, 4), (64, 32, 4), (128, 64, 8), (64, 64, 4)):
                        if T == 2048 and (bm, bk, nw) != (128, 32, 4):
                            continue
                        fn = (lambda *x, lowp=lowp, cb_pre=cb_pre, bm=bm, bk=bk, nw=nw, **k:
                              triton_ssd_scan_varlen(*x, lowp=lowp, cb_pre=cb_pre, block_m=bm,
                                                     block_k=bk, num_warps=nw, **k))
                        sw("ssd", mk_ssd, T, fn, reps=5, lowp=lowp, cb_pre=cb_pre, block_m=bm,
                           block_k=bk, num_warps=nw)
        for B, s in ((1, 1), (1, 4), (8, 1), (8, 4), (32, 4)):
            for ns in (None, 1):
                fn = (lambda *x, ns=ns, **k: triton_paged_attention(*x, num_splits=ns, **k))
                sw("attn_decode", mk_attn_decode, B, s, fn, num_splits=str(ns))
        for bt in (16, 32, 64):
            for bc in (64, 128, 256):
                for nw in (4, 8):
                    fn = (lambda *x, bt=bt, bc=bc, nw=nw, **k:
                          triton_causal_conv1d_varlen(*x, block_t=bt, block_c=bc, num_warps=nw,
                                                      **k))
                    sw("conv_varlen", mk_conv_varlen, 8192, fn, reps=5, block_t=bt, block_c=bc,
                       num_warps=nw)
    if args.sweep_conv:
        from benchmarks.conv_sweep import conv_variant_sweep
        conv_variant_sweep(triton_causal_conv1d_update, bw, sweep)
    if (args.sweep or args.sweep_conv) and not args.conv_variants_only:
        for B, s in ((64, 1), (256, 1), (64, 4), (256, 4)):
            for tm in (True, False):
                for bc in (128, 256, 512, 1024):
                    for nw in (2, 4, 8):
                        if nw * 32 > bc:
                            continue
                        fn = (lambda *x, bc=bc, nw=nw, **k:
                              triton_causal_conv1d_update(*x, block_c=bc, num_warps=nw, **k))
                        sw("conv_update", mk_conv_update, B, s, fn, tm, block_c=bc, num_warps=nw,
                           token_major=tm)
    if args.profile:
        # where the time goes inside the prefill ops (default configs)
        for name, (mk, a) in {"ssd 1x8192": (mk_ssd, (8192, triton_ssd_scan_varlen)),
                              "conv_varlen 1x8192": (mk_conv_varlen,
                                                     (8192, triton_causal_conv1d_varlen))}.items():
            _, calls, _ = mk(*a)
            calls[0]()
            torch.cuda.synchronize()
            try:
                with torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        calls[0]()
                    torch.cuda.synchronize()
            except Exception as exc:
                print(f"profiler failed: {exc}", flush=True)
                continue
            print(f"\nkernels of {name} (5 calls):", flush=True)
            for ev in sorted(prof.key_averages(), key=lambda e: -getattr(
                    e, "device_time_total", getattr(e, "cuda_time_total", 0)))[:10]:
                tot = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0))
                if tot > 0:
                    print(f"  {ev.key[:60]:60s} {tot / 5 / 1000:.4f} ms/call", flush=True)

    text = "\n".join([head, f"device-to-device copy: {bw:.0f} GB/s (read + write)", ""]
                     + hdr + rows)
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(head=head, copy_gbs=bw, rows=raw, sweep=sweep),
                                              indent=1))


if __name__ == "__main__":
    main()
