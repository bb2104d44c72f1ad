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
    python benchmarks/vs_mamba_ssm.py --variants [--new-only] [--profile]  # our SSD configs
    python benchmarks/vs_mamba_ssm.py --state-variants [--profile]  # only the step-2 configs
    python benchmarks/vs_mamba_ssm.py --list-variants       # print them (no CUDA needed)

``--variants`` times our SSD scan at 8192 tokens with each chunk-output / chunk-state config of
``VARIANTS`` (keyword options of ``triton_ssd_scan_varlen``; see its docstring) next to the
default (``--state-variants``: the chunk-state configs ``STATE_VARIANTS`` only, which run the
unfused steps 2 and 3; the default fuses them); with
``--profile`` also the GPU time of each config's steps 2 and 3 (the fused kernel, or the
chunk-state and state-pass kernels) and step-4 kernels
(C.B precompute + chunk output) from torch.profiler.  Without mamba-ssm installed only our side
is timed (its columns read n/a).
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import event_ms  # noqa: E402
from hybrid_engine.mamba_cache.ops import selective_state_update  # noqa: E402
from hybrid_engine.mamba_cache.ops.mamba_ssm_ref import load_mamba_ssm as _load_mamba_ssm  # noqa: E402

H, P, G, NST, CS = 128, 64, 8, 128, 128
DT = torch.bfloat16
DEV = "cuda"


def load_mamba_ssm():
    """(mamba_chunk_scan_combined, selective_state_update), or (None, None) without mamba-ssm."""
    scan, ssu, why = _load_mamba_ssm()
    if why is not None:
        print(f"mamba-ssm not importable ({why}): timing ours only", flush=True)
    return scan, ssu


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
    from hybrid_engine.mamba_cache.ops.triton_ssd import triton_ssd_scan_varlen   # what ssd_scan_varlen runs
    ours = lambda **kw: triton_ssd_scan_varlen(  # noqa: E731
        x, dt, dt_bias, A, B, C, D, qsl, init, CS, max_seqlen=T, out_dtype=DT, **kw)
    if chunk_scan is None:
        return ours, None, "n/a (no mamba-ssm)"
    ms = lambda: chunk_scan(x[None], dt[None], A, B[None], C[None], CS, D=D,  # noqa: E731
                            dt_bias=dt_bias, dt_softplus=True, return_final_states=True)
    # sanity: same math (bf16 inputs; loose bound, report only)
    y, fin = ours()
    out, mfin = ms()
    err = float((y.float() - out[0].float()).abs().max()) / float(y.float().abs().max())
    errf = float((fin - mfin).abs().max()) / float(fin.abs().max())
    return ours, ms, f"y {err:.1e}, final {errf:.1e}"


# our SSD configs timed by --variants, next to the default (bf16: the multi-head chunk-output
# kernel, 4 heads per program, block_m 64, C.B in bf16, 2 stages; triton_ssd._DEFAULTS).
# ``_PH`` = the per-head kernel (heads_per_program=1; its defaults: block_m 128, block_k 32,
# 4 warps, all of P, Triton's stages, C.B in float32; the default before 2026-11-22).
_PH = dict(heads_per_program=1)
# Session-2 configs of the per-head kernel (none beat its defaults; chunk-first program order):
OLD_VARIANTS = [dict(_PH, **kw) for kw in (
    dict(num_stages=2), dict(num_stages=3), dict(num_stages=4), dict(block_m=64, num_stages=3),
    dict(cb_pre=True, block_p=32), dict(cb_pre=True, block_p=32, block_m=64),
    dict(cb_pre=True, block_p=32, num_stages=3),
    dict(cb_pre=True, block_p=32, block_m=64, num_stages=4), dict(block_p=32, block_m=64),
    dict(cb_pre=True, block_m=64, num_stages=4))]
# 2026-11-22 configs (triton_ssd_scan_varlen docstring).  ``_CBM`` = C.B precomputed in bf16.
# (A "tile-first" program order was tried too, 0.78-1.27 ms; removed after a GPU test of it with
# block_k=64 and 3 stages hit an illegal address.)
_CBM = dict(cb_pre=True, cb_dtype="model")
NEW_VARIANTS = [
    _PH,    # the per-head kernel with its defaults (H100: 0.822 ms vs 0.740 ms, the default)
] + [dict(_PH, **kw) for kw in (
    # C.B precomputed once per (chunk, group) in bf16, read as [block_m, block_k] tiles
    dict(**_CBM), dict(block_m=64, **_CBM), dict(block_m=64, **_CBM),
    dict(block_m=64, block_p=32, **_CBM), dict(block_m=64, block_k=64, **_CBM),
    dict(block_m=64, num_stages=2, **_CBM),
    dict(block_m=64, num_stages=4, **_CBM),
    dict(block_m=128, num_warps=8, **_CBM), dict(block_m=64, num_warps=2, **_CBM),
    dict(block_m=32, num_warps=2, **_CBM),
    # the same in float32 (mamba-ssm's C.B dtype)
    dict(cb_pre=True, block_m=64), dict(cb_pre=True, block_m=64, block_p=32),
)] + [
    # several heads of a group per program, C.B tile in registers, loop over the heads (the
    # default is heads_per_program=4, block_m=64, cb_dtype="model", num_stages=2)
    dict(heads_per_program=2, block_m=64, cb_dtype="model", num_stages=2),
    dict(heads_per_program=4, block_m=64, cb_dtype="model", num_stages=3),
    dict(heads_per_program=4, block_m=64, cb_dtype="float32", num_stages=2),
    dict(heads_per_program=4, block_m=64, block_p=32, cb_dtype="model", num_stages=2),
    dict(heads_per_program=2, block_m=128, num_warps=8, cb_dtype="model", num_stages=2),
    dict(heads_per_program=4, block_m=128, num_warps=8, cb_dtype="model", num_stages=2),
    dict(heads_per_program=8, block_m=128, num_warps=8, cb_dtype="model", num_stages=2),
    dict(heads_per_program=4, block_m=64, num_stages=2, **_CBM),
]
# chunk-state (step 2) configs (triton_ssd_state.launch_chunk_state): K step, stages, warps, P
# block.  Multi-head programs (2 or 4 heads sharing the B tile) were swept on 2026-11-22 and lost
# (201-1104 us vs 165 us for K 32 with one head; results/2026-11-22-vs-mamba-ssm-h100.md).
# They configure the unfused kernels (fused_pass=False); the default fuses steps 2 and 3
# (triton_ssd_fused_pass), so the first state variant is the unfused default itself.
STATE_VARIANTS = [dict(fused_pass=False)] + [dict(state_block_k=bk, fused_pass=False, **kw) for bk, kw in (
    (64, {}), (16, {}), (32, dict(state_num_stages=2)), (32, dict(state_num_stages=3)),
    (32, dict(state_num_stages=4)), (32, dict(state_num_warps=8)), (16, dict(state_num_stages=3)),
    (32, dict(state_block_p=32)))]
VARIANTS = OLD_VARIANTS + NEW_VARIANTS + STATE_VARIANTS


def step_us(fn):
    """GPU us per call of steps 2 and 3 (the fused kernel by default, the chunk-state and
    state-pass kernels with fused_pass=False: comparable either way) and of the chunk-output step
    (step 4: C.B precompute + chunk-output kernels)."""
    ks = profile_kernels(fn)
    return (sum(us for k, us in ks if "_chunk_state" in k or "_state_pass" in k or "_chunk_pass" in k),
            sum(us for k, us in ks if "_chunk_out" in k or "_chunk_cb" in k))


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
    ap.add_argument("--new-only", action="store_true", help="--variants: skip OLD_VARIANTS")
    ap.add_argument("--state-variants", action="store_true",
                    help="time only STATE_VARIANTS (step-2 configs) at 8192")
    ap.add_argument("--list-variants", action="store_true", help="print VARIANTS and exit")
    a = ap.parse_args()
    variants = (STATE_VARIANTS if a.state_variants else
                NEW_VARIANTS + STATE_VARIANTS if a.new_only else VARIANTS)
    a.variants = a.variants or a.state_variants
    if a.list_variants:
        for kw in variants:
            print(kw)
        return
    chunk_scan, ms_ssu = load_mamba_ssm()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    rows = []
    for T in (2048, 8192):
        ours, ms, chk = ssd_case(T, chunk_scan)
        t_o = time_ms(ours, a.reps, a.inner)
        t_m = time_ms(ms, a.reps, a.inner) if ms is not None else math.nan
        rows.append((f"SSD prefill 1x{T} (bf16, cs={CS})", "1 call each", t_o, t_m, chk))
        print(rows[-1], flush=True)
        if a.variants and T == 8192:
            y0 = ours()[0].float()
            for kw in [{}] + variants:
                fn = lambda kw=kw, f=ours: f(**kw)  # noqa: E731
                try:
                    dy = float((fn()[0].float() - y0).abs().max()) / float(y0.abs().max())
                    t_v = time_ms(fn, a.reps, a.inner)
                    k_us = (", steps 2+3 {:.1f} us, step 4 {:.1f} us".format(*step_us(fn))
                            if a.profile else "")
                except Exception as exc:   # a config that does not compile / fit: report, go on
                    print(f"  variant {kw}: FAILED {type(exc).__name__}: {str(exc)[:200]}",
                          flush=True)
                    continue
                name = kw or "(default)"
                vs_ms = "" if math.isnan(t_m) else f", {t_m / t_v:.2f}x mamba-ssm"
                print(f"  variant {name}: {t_v:.4f} ms ({t_o / t_v:.2f}x default{vs_ms}{k_us}; "
                      f"y vs default {dy:.1e})", flush=True)
        if a.profile and T == 8192:
            for name, fn in (("ours", ours), ("mamba-ssm", ms)):
                if fn is None:
                    continue
                print(f"  kernels of {name} SSD 1x{T}:", flush=True)
                for k, us in profile_kernels(fn):
                    print(f"    {k[:70]:70s} {us:8.1f} us/call", flush=True)
        del ours, ms
        torch.cuda.empty_cache()
    for Bsz in (64, 256):
        for s in (1, 4):
            ours, ms = ssu_case(Bsz, s, ms_ssu)
            t_o = time_ms(ours, a.reps, a.inner)
            t_m = time_ms(ms, a.reps, a.inner) if ms_ssu is not None else math.nan
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
        ms_col, ratio = (("n/a", "n/a") if math.isnan(t_m) else
                         (f"{t_m:.4f}", f"{t_m / t_o:.2f}x"))
        lines.append(f"| {name} | {how} | {t_o:.4f} | {ms_col} | {ratio} | {chk} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        Path(a.out).write_text(table + "\n")


if __name__ == "__main__":
    main()
