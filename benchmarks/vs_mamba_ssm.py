"""Our SSD scan and selective_state_update vs mamba-ssm's Triton kernels (CUDA only).

Nemotron-H-8B mixer shapes: 128 heads x 64 head_dim, 8 groups, d_state 128, chunk 128; bf16
inputs, float32 SSM state.
- SSD prefill, one sequence of 2048 / 8192 tokens: our ``ssd_scan_varlen`` (y bf16 + final
  state) vs ``mamba_chunk_scan_combined`` (D, dt_bias, dt_softplus, return_final_states; out bf16).
- State update, B = 64 / 256 rows: s=1 vs one ``selective_state_update`` launch (tied per-head
  views, as Mamba2 passes them); our s=4 (per-token checkpoints, ONE launch) vs mamba-ssm's 4
  launches of s=1.  mamba-ssm keeps no per-token states: keeping them for rollback would also need
  a state copy after each launch, which is NOT included here (4 launches only).

Timing: eager launches (Python launch overhead included, no CUDA graphs), warm-up calls first
(mamba-ssm's first SSD call autotunes), then the median over ``--reps`` torch.cuda.Event-timed
groups of ``--inner`` calls.  mamba-ssm comes from its pure-python wheel through the same
``selective_scan_cuda`` stub as tests/gpu/test_mamba_ssm_crosscheck.py.

    python benchmarks/vs_mamba_ssm.py [--reps 15] [--inner 10] [--out table.md]
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import event_ms  # noqa: E402
from mamba_cache.ops import selective_state_update  # noqa: E402

H, P, G, NST, CS = 128, 64, 8, 128, 128
DT = torch.bfloat16
DEV = "cuda"


def load_mamba_ssm():
    try:
        importlib.import_module("selective_scan_cuda")
    except ImportError:
        sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update as ms_ssu
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return mamba_chunk_scan_combined, ms_ssu


def time_ms(fn, reps, inner, warmup=3):
    """Median over reps of the per-call GPU time of `inner` back-to-back calls, after warm-up."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_ms(fn, inner) for _ in range(reps))


def rnd(*shape, dtype=DT, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def ssd_case(T, chunk_scan):
    x, dt = rnd(T, H, P), rnd(T, H, scale=0.5)
    dt_bias, A, D = rnd(H, dtype=torch.float32) - 2, -torch.rand(H, device=DEV) - 0.5, rnd(H)
    B, C = rnd(T, G, NST), rnd(T, G, NST)
    qsl = torch.tensor([0, T], dtype=torch.int32, device=DEV)
    init = torch.zeros(1, H, P, NST, device=DEV)
    from mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen   # what ssd_scan_varlen runs
    ours = lambda **kw: triton_ssd_scan_varlen(  # noqa: E731
        x, dt, dt_bias, A, B, C, D, qsl, init, CS, max_seqlen=T, out_dtype=DT, **kw)
    ms = lambda: chunk_scan(x[None], dt[None], A, B[None], C[None], CS, D=D,  # noqa: E731
                            dt_bias=dt_bias, dt_softplus=True, return_final_states=True)
    # sanity: same math (bf16 inputs; loose bound, report only)
    y, fin = ours()
    out, mfin = ms()
    err = float((y.float() - out[0].float()).abs().max()) / float(y.float().abs().max())
    errf = float((fin - mfin).abs().max()) / float(fin.abs().max())
    return ours, ms, f"y {err:.1e}, final {errf:.1e}"


# our SSD configs timed by --variants (defaults: block_m 128, block_k 32, 4 warps, all of P)
VARIANTS = [dict(num_stages=2), dict(num_stages=3), dict(num_stages=4),
            dict(block_m=64, num_stages=3), dict(cb_pre=True, block_p=32),
            dict(cb_pre=True, block_p=32, block_m=64), dict(cb_pre=True, block_p=32, num_stages=3),
            dict(cb_pre=True, block_p=32, block_m=64, num_stages=4),
            dict(block_p=32, block_m=64), dict(cb_pre=True, block_m=64, num_stages=4)]


def profile_kernels(fn, n=5):
    """[(kernel name, us per call)] of n calls of fn, by torch.profiler (CUDA activity)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        tot = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if tot > 0:
            out.append((ev.key, tot / n))
    return sorted(out, key=lambda r: -r[1])


def ssu_case(Bsz, s, ms_ssu):
    pool = torch.randn(Bsz + 1, s, H, P, NST, device=DEV)           # ours: [S, 1+K, H, P, N]
    ms_state = torch.randn(Bsz + 1, H, P, NST, device=DEV)          # mamba-ssm: [S, H, P, N]
    dt_bias, A, D = rnd(H, dtype=torch.float32) - 2, -torch.rand(H, device=DEV) - 0.5, rnd(H)
    x, dt = rnd(Bsz, s, H, P), rnd(Bsz, s, H, scale=0.5)
    Bm, Cm = rnd(Bsz, s, G, NST), rnd(Bsz, s, G, NST)
    slots = torch.arange(1, Bsz + 1, device=DEV, dtype=torch.int32)
    acc = torch.ones(Bsz, device=DEV, dtype=torch.int32)
    ours = lambda: selective_state_update(pool, x, dt, dt_bias, A, Bm, Cm, D, slots, acc,  # noqa
                                          out_dtype=DT)
    A_t = A[:, None, None].expand(H, P, NST)
    D_t, db_t = D[:, None].expand(H, P), dt_bias[:, None].expand(H, P)
    dts = [dt[:, t, :, None].expand(Bsz, H, P) for t in range(s)]

    def ms():
        for t in range(s):   # s launches; no per-token state copies (see module docstring)
            ms_ssu(ms_state, x[:, t], dts[t], A_t, Bm[:, t], Cm[:, t], D=D_t, z=None,
                   dt_bias=db_t, dt_softplus=True, state_batch_indices=slots)
    return ours, ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true", help="per-kernel SSD times at 8192, both")
    ap.add_argument("--variants", action="store_true", help="time our SSD block configs at 8192")
    a = ap.parse_args()
    chunk_scan, ms_ssu = load_mamba_ssm()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for T in (2048, 8192):
        ours, ms, chk = ssd_case(T, chunk_scan)
        t_o, t_m = time_ms(ours, a.reps, a.inner), time_ms(ms, a.reps, a.inner)
        rows.append((f"SSD prefill 1x{T} (bf16, cs={CS})", "1 call each", t_o, t_m, chk))
        print(rows[-1], flush=True)
        if a.variants and T == 8192:
            for kw in VARIANTS:
                t_v = time_ms(lambda kw=kw, f=ours: f(**kw), a.reps, a.inner)
                print(f"  variant {kw}: {t_v:.4f} ms ({t_m / t_v:.2f}x mamba-ssm)", flush=True)
        if a.profile and T == 8192:
            for name, fn in (("ours", ours), ("mamba-ssm", ms)):
                print(f"  kernels of {name} SSD 1x{T}:", flush=True)
                for k, us in profile_kernels(fn):
                    print(f"    {k[:70]:70s} {us:8.1f} us/call", flush=True)
        del ours, ms
        torch.cuda.empty_cache()
    for Bsz in (64, 256):
        for s in (1, 4):
            ours, ms = ssu_case(Bsz, s, ms_ssu)
            t_o, t_m = time_ms(ours, a.reps, a.inner), time_ms(ms, a.reps, a.inner)
            how = ("1 launch each" if s == 1 else
                   f"ours 1 launch (s={s}, per-token states) vs mamba-ssm {s} launches of s=1 "
                   "(no state copies)")
            rows.append((f"state update B={Bsz} s={s}", how, t_o, t_m, ""))
            print(rows[-1], flush=True)
            del ours, ms
            torch.cuda.empty_cache()
    lines = ["| op | launches | ours (ms) | mamba-ssm (ms) | mamba-ssm / ours | check (rel err) |",
             "|---|---|---|---|---|---|"]
    for name, how, t_o, t_m, chk in rows:
        lines.append(f"| {name} | {how} | {t_o:.4f} | {t_m:.4f} | {t_m / t_o:.2f}x | {chk} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        Path(a.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
