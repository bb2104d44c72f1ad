"""The conv-update variant sweep of ``benchmarks/kernels.py --sweep-conv``: the configurations
(options of ``triton_causal_conv1d_update``) and the timing loop, with kernels.py's graph timer and
byte accounting.

    python benchmarks/kernels.py --sweep-conv [--conv-variants-only]
"""
from __future__ import annotations

import torch


CONV_VARIANT_SHAPES = [(B, s) for s in (1, 4) for B in (64, 128, 256)]


def conv_variant_configs():
    """(label, triton_causal_conv1d_update keyword options, tap_major_weight) timed by
    --sweep-conv at every CONV_VARIANT_SHAPES shape; the first entry is the default config.
    tap_major_weight: the weight passed as a [C, W] view of [W, C] storage (strides (1, C)), so
    that a tap's weights are contiguous (what a model-side re-layout of conv1d.weight would
    give); the kernels accept any strides."""
    # default: the cols kernel, 2 rows per program, 512 channels, 8 warps (16-bit), .cs stores
    cfgs = [("default", {}, False)]
    # the previous kernel ([tokens, channels] tiles per row), its defaults and fatter programs
    cfgs.append(("window", dict(variant="window"), False))
    for bc, nw in ((1024, 8), (1024, 16), (2048, 16)):
        cfgs.append((f"window bc={bc} nw={nw}", dict(variant="window", block_c=bc, num_warps=nw), False))
    # cols kernel without cache hints: 2 channels per thread (4-byte vectors; the [C, W] weights
    # of a thread are one 16-byte load), rows_per_program rows sharing the weights
    nohint = dict(cache_hints="none")
    for rows in (1, 2, 4, 8):
        for bc, nw in ((256, 4), (512, 8), (1024, 16)):
            cfgs.append((f"cols r={rows} bc={bc} nw={nw}",
                         dict(rows_per_program=rows, block_c=bc, num_warps=nw, **nohint), False))
    # wider vectors per thread (strided per-tap weight loads)
    for rows in (1, 2):
        for bc, nw in ((512, 4), (512, 2), (1024, 4)):
            cfgs.append((f"cols r={rows} bc={bc} nw={nw} taps",
                         dict(rows_per_program=rows, block_c=bc, num_warps=nw,
                              weight_load="taps", **nohint), False))
    # load order, cache hints, grid order, programmatic dependent launch on two bases
    for rows in (1, 2):
        base = dict(rows_per_program=rows, block_c=512, num_warps=8, **nohint)
        name = f"cols r={rows} bc=512 nw=8"
        for tag, extra in (("inputs_first", dict(inputs_first=True)),
                           ("hints=evict", dict(cache_hints="evict")),
                           ("hints=cg", dict(cache_hints="cg")),
                           ("hints=cs", dict(cache_hints="cs")),
                           ("hints=evict+cg+cs", dict(cache_hints="evict+cg+cs")),
                           ("channels_fast", dict(channels_fast=True)),
                           ("pdl=1", dict(pdl=1)),
                           ("pdl=2", dict(pdl=2)),
                           ("pdl=2 inputs_first hints=evict",
                            dict(pdl=2, inputs_first=True, cache_hints="evict"))):
            cfgs.append((f"{name} {tag}", dict(base, **extra), False))
    # tap-major weight layout (needs the model to store conv1d.weight that way)
    cfgs.append(("window +wT", dict(variant="window"), True))
    for rows, bc, nw in ((1, 512, 8), (2, 512, 8), (1, 512, 2), (2, 512, 2), (4, 1024, 4),
                         (1, 1024, 4)):
        cfgs.append((f"cols r={rows} bc={bc} nw={nw} +wT",
                     dict(rows_per_program=rows, block_c=bc, num_warps=nw, **nohint), True))
    return cfgs


def conv_variant_sweep(update_fn, bw, sweep, shapes=None, configs=None):
    """Time every conv_variant_configs() entry at every shape (token-major pool, the data built
    once per shape) with mk_conv_update's byte accounting; print ms, % of copy bandwidth and the
    speedup over the default config, then the configs ranked by their worst shape."""
    from benchmarks.kernels import bench, mk_conv_update   # kernels.py imports this module lazily
    shapes = shapes or CONV_VARIANT_SHAPES
    configs = configs or conv_variant_configs()
    cur = {}
    tap_major = {}

    def impl(x, w, b, pool, slots, acc):
        if cur["wT"]:
            key = (w.data_ptr(), tuple(w.shape))
            if key not in tap_major:          # filled by the warm-up calls, before any capture
                tap_major[key] = w.t().contiguous().t()
            w = tap_major[key]
        return update_fn(x, w, b, pool, slots, acc, **cur["kw"])

    table = {}                                 # label -> {(B, s): (ms, pct)}
    print("\nconv_update variants (graph-timed ms, % of copy BW, speedup over default)",
          flush=True)
    for B, s in shapes:
        _, calls, nb = mk_conv_update(B, s, impl)
        base = None
        for label, kw, wt in configs:
            cur.update(kw=kw, wT=wt)
            try:
                t = bench(calls)[0]
            except Exception as exc:  # a config that does not compile or launch: report, go on
                print(f"  B={B} s={s} {label:52s} FAILED {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:120] if str(exc) else ''}", flush=True)
                torch.cuda.synchronize()
                continue
            pct = 100 * nb / (t * 1e-3) / 1e9 / bw
            base = base or t
            table.setdefault(label, {})[(B, s)] = (t, pct)
            sweep.append(dict(op="conv_update_variant", args=[str(B), str(s)], label=label,
                              ms=t, pct_copy=pct, speedup=base / t, tap_major_weight=wt,
                              **{k: str(v) for k, v in kw.items()}))
            print(f"  B={B} s={s} {label:52s} {t:.4f} ms  {pct:3.0f}%  {base / t:.2f}x",
                  flush=True)
        del calls
        torch.cuda.empty_cache()
    ranked = sorted(((min(p for _, p in r.values()), label, r) for label, r in table.items()
                     if len(r) == len(shapes)), key=lambda e: -e[0])
    cols = " ".join(f"B={B},s={s}" for B, s in shapes)
    print(f"\nconv_update variants by worst-shape % of copy BW ({cols}):", flush=True)
    for worst, label, r in ranked:
        print(f"  {label:52s} worst {worst:3.0f}%  "
              + " ".join(f"{r[sh][1]:3.0f}%" for sh in shapes), flush=True)
    return table
