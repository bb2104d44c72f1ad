"""MoE kernel cases shared by the GPU tests (test_moe_kernels.py) and the Triton interpreter run
(moe_interpret_cases.py): random inputs, poisoned outputs, comparison with the torch twins of
hybrid_engine.models.moe_ops. Each check returns the largest error it saw."""
from __future__ import annotations

import torch

from hybrid_engine.models.moe_align import align_pairs
from hybrid_engine.models.moe_ops import RouteSpec, grouped_experts_ref, route_ref
from poisoned import nan_filled

TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def make_ids(T: int, E: int, k: int, load: str, gen: torch.Generator) -> torch.Tensor:
    """[T, k] distinct experts per token. load: "uniform"; "ragged" (Zipf-like: a few experts take
    most tokens, many take none); "one" (every token's first choice is expert E // 2, so it gets
    all T tokens); "few" (only experts 0..k are ever used: most experts get zero tokens)."""
    if load == "uniform":
        p = torch.ones(E)
    elif load == "ragged":
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.5
        p = p[torch.randperm(E, generator=gen)]
    elif load == "few":
        p = torch.zeros(E)
        p[:k + 1] = 1.0
    elif load == "one":
        p = torch.ones(E)
        p[E // 2] = 0.0
    else:
        raise ValueError(load)
    n = k - 1 if load == "one" else k
    ids = (torch.multinomial(p.float().expand(T, E), n, replacement=False, generator=gen) if n
           else torch.zeros(T, 0, dtype=torch.long))
    if load == "one":
        ids = torch.cat([torch.full((T, 1), E // 2, dtype=ids.dtype), ids], 1)
    return ids


def check_align(device, T: int, E: int, k: int, block_m: int, load: str = "ragged", seed: int = 0,
                align_fn=align_pairs) -> int:
    gen = torch.Generator().manual_seed(seed)
    ids = make_ids(T, E, k, load, gen).to(device)
    al = align_fn(ids, E, block_m)
    ref = align_pairs(ids, E, block_m)        # the torch ops: same stable order, same result
    assert torch.equal(al.sorted_pairs.cpu(), ref.sorted_pairs.cpu())
    assert torch.equal(al.block_expert.cpu(), ref.block_expert.cpu())
    assert torch.equal(al.num_rows.cpu(), ref.num_rows.cpu())
    P = T * k
    rows = int(al.num_rows)
    assert rows % block_m == 0 and rows <= al.sorted_pairs.numel()
    sp = al.sorted_pairs.cpu().long()
    used = sp[:rows]
    real = used[used < P]
    assert sorted(real.tolist()) == list(range(P)), "every pair exactly once"
    assert bool((sp[rows:] == P).all())
    flat = ids.reshape(-1).cpu().long()
    be = al.block_expert.cpu().long()
    for b in range(rows // block_m):
        blk = used[b * block_m:(b + 1) * block_m]
        blk = blk[blk < P]
        assert blk.numel() > 0, "no empty tiles inside the used rows"
        assert bool((flat[blk] == be[b]).all()), f"tile {b} mixes experts"
    counts = torch.bincount(flat, minlength=E)
    assert rows == int(((counts + block_m - 1) // block_m * block_m).sum())
    return 0


def check_route(route_fn, device, T: int, E: int, k: int, n_group: int = 1, topk_group: int = 1,
                renorm: bool = True, scale: float = 2.5, seed: int = 0, scoring: str = "sigmoid") -> float:
    """route_fn(logits, bias, spec, counts, valid, out) -> (ids, w): the Triton router. ``scoring``
    "softmax" (Granite-4.0-H): no correction bias (zeros, as the model passes)."""
    gen = torch.Generator().manual_seed(seed)
    spec = RouteSpec(num_experts=E, top_k=k, n_group=n_group, topk_group=topk_group,
                     norm_topk_prob=renorm, scale=scale, scoring=scoring)
    logits = (2.0 * torch.randn(T, E, generator=gen)).to(device)
    bias = (0.05 * torch.randn(E, generator=gen)).to(device)
    if scoring == "softmax":
        bias = torch.zeros_like(bias)
    valid = (torch.rand(T, generator=gen) < 0.8).long().to(device) * 17     # slot-mapping-like
    base = torch.randint(0, 1000, (E,), generator=gen, dtype=torch.int32).to(device)
    counts = base.clone()
    out = (torch.full((T, k), -7, dtype=torch.int32, device=device),
           torch.full((T, k), float("nan"), device=device))
    ids, w = route_fn(logits, bias, spec, counts, valid, out)
    assert ids is out[0] and w is out[1]
    ref_ids, ref_w = route_ref(logits, bias, spec)
    ids_s, order = ids.long().sort(-1)
    ref_s, ref_order = ref_ids.sort(-1)
    same = (ids_s == ref_s).all(-1)
    if not bool(same.all()):      # only where the k-th and (k+1)-th choices are within rounding
        choice = (logits.float() if scoring == "softmax" else logits.float().sigmoid() + bias)
        choice = choice.sort(-1, descending=True)[0]
        gap = (choice[:, k - 1] - choice[:, k]).abs()
        assert bool((gap[~same] < 1e-5).all()), "router picked different experts away from a tie"
    err = (w.gather(1, order) - ref_w.gather(1, ref_order))[same].abs().max().item() if bool(same.any()) else 0.0
    assert err <= 1e-5 * max(1.0, scale), f"weights differ by {err}"
    assert bool((ids >= 0).all()) and bool((ids < E).all())
    # counters: each valid token's k choices added to what was there
    want = base.long() + torch.zeros(E, dtype=torch.long, device=device).index_add_(
        0, ids.reshape(-1).long(), (valid != 0).long().repeat_interleave(k))
    assert torch.equal(counts.long(), want)
    return err


def check_experts(experts_fn, device, dtype, T: int, E: int, k: int, D: int, F: int, D_out: int | None = None,
                  load: str = "uniform", add: bool = False, seed: int = 0, activation: str = "relu2",
                  **kw) -> float:
    """experts_fn(h, w_up, w_down, ids, weights, add, out=..., **kw) -> [T, D_out]; ``activation``
    "swiglu" gives w_up 2F rows (gate then up) and is passed on to experts_fn."""
    D_out = D if D_out is None else D_out
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, D, generator=gen).to(device, dtype)
    up_rows = 2 * F if activation == "swiglu" else F
    # the expert weights are drawn where they live: on the CPU a 512-expert Super-like case's
    # 2.8 G draws took ~30 s per test and made the slow sweep a three-hour run
    wgen = torch.Generator(device=device).manual_seed(seed)
    w_up = (torch.randn(E, up_rows, D, generator=wgen, device=device) / D ** 0.5).to(dtype)
    w_down = (torch.randn(E, D_out, F, generator=wgen, device=device) / F ** 0.5).to(dtype)
    ids = make_ids(T, E, k, load, gen).to(device, torch.int32)
    weights = (torch.rand(T, k, generator=gen) * 2.0 / k).to(device)
    extra = torch.randn(T, D_out, generator=gen).to(device, dtype) if add else None
    out = torch.full((T, D_out), float("nan"), dtype=dtype, device=device)
    if activation != "relu2":
        kw["activation"] = activation
    got = experts_fn(h, w_up, w_down, ids, weights, extra, out=out, **kw)
    assert got is out
    ref = grouped_experts_ref(h, w_up, w_down, ids.long(), weights, activation)
    if add:
        ref = ref + extra
    assert bool(torch.isfinite(got).all()), "unwritten (poisoned) outputs"
    err = (got.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert scale > 0.1
    assert err <= TOL[dtype] * max(1.0, scale), f"max error {err} (output scale {scale})"
    return err


def check_router_logits(device, T: int, E: int, D: int, seed: int = 0, tiles=None, tell_parts: bool = True) -> float:
    """``router_logits_triton``: bf16 x [T, D] @ float32 w [E, D]^T in float32 on the bf16 tensor
    cores (the weight in three bf16 parts) against the exact product (float64), outputs NaN-filled;
    T, E, D ragged against ``tiles`` (None: the rule's). The weights span 2^-12 .. 2^4 in magnitude
    with full float32 mantissas. The error, relative to the sum of |products|, must stay within
    1.5e-6: float32 class, far from one bf16 part (~4e-3) or TF32. A float32 GEMM sits at ~1e-7 ..
    4e-7 here. On the H200 (2026-11-29) the kernel measured 1.9e-7 .. 2.6e-7 at D 2688 / 4096 and
    6.5e-7 at D 80, and its earlier form, with the tensor cores accumulating a whole row, 2.3e-6 ..
    3.3e-6: the bound fails that form. ``tell_parts``: also under a third of the error of the
    weight's first two bf16 parts alone, so that a kernel dropping the third part fails; only narrow
    rows tell them apart with a margin (D 80: three parts 4e-7 on CPU, 6.5e-7 on the H200, two
    3.5e-6; at D 2688 two parts give ~8e-7)."""
    from hybrid_engine.models import triton_moe_route as tr
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    w = torch.randn(E, D, generator=gen) * torch.exp2(torch.randint(-12, 5, (E, D), generator=gen).float())
    ref = torch.nn.functional.linear(x.double(), w.double())
    scale = torch.nn.functional.linear(x.double().abs(), w.double().abs())     # the sums of |products|
    hi = w.to(torch.bfloat16).float()
    two_parts = (hi + (w - hi).to(torch.bfloat16).float()).double()
    two_part_err = ((torch.nn.functional.linear(x.double(), two_parts) - ref).abs() / scale).max().item()
    rule = tr.ROUTER_TILES
    try:
        tr.ROUTER_TILES = tiles
        with nan_filled():
            got = tr.router_logits_triton(x.to(device), w.to(device)).cpu()
    finally:
        tr.ROUTER_TILES = rule
    assert got.dtype == torch.float32 and got.shape == (T, E) and torch.isfinite(got).all()
    err = ((got.double() - ref).abs() / scale).max().item()
    what = f"router logits T={T} E={E} D={D}: error {err:.2e} of the |products| sum (two bf16 parts: {two_part_err:.2e})"
    assert err <= 1.5e-6, what
    if tell_parts:
        assert err <= two_part_err / 3, what
    return err


def check_rowwise(fn, device, dtype, T: int, N: int, K: int, w_dtype=None, relu2: bool = False,
                  out_dtype=None, seed: int = 0) -> float:
    """fn = rowwise_linear_triton: x [T, K] @ w [N, K]^T (float32 sum for router logits, or rounded
    to x's dtype as F.linear, then relu²) vs torch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=gen).to(device, dtype)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(device, w_dtype or dtype)
    got = fn(x, w, relu2=relu2, out_dtype=out_dtype)
    if out_dtype == torch.float32 and dtype != torch.float32:
        ref = torch.nn.functional.linear(x.float(), w.float())          # the router's rule
        tol = 1e-5
    else:
        ref = torch.nn.functional.linear(x, w)
        ref = torch.nn.functional.relu(ref).square() if relu2 else ref
        tol = TOL[dtype]
    assert got.dtype == ref.dtype and got.shape == ref.shape
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), err
    return err
