"""Cases for the fused proposal's helpers (``step/single_token_steps.py``, ``step/argmax_rows.py``):
the Triton kernels against independent torch code on random inputs.

- ``single_token_meta``: every single-token step's positions, slot mapping and lengths, each row's
  validity and newest-sample index, against ``spec.drafters.common.single_token_batch`` built step
  by step as the fused proposals used to (pads, rows that kept nothing, positions past the block
  table, both pad rules);
- ``argmax_rows``: against ``torch.argmax`` (first index of ties within and across 1024-wide
  blocks, NaN after +inf, rows of -inf, 16-bit logits, odd widths).

Run as a script (``TRITON_INTERPRET=1``) it prints one ``CASE name OK|FAIL`` line per case;
tests/spec/test_single_token_steps.py runs it and imports ``check_meta`` / ``check_argmax`` for the
torch twin and for CUDA (tests/gpu/test_spec_step_graphs.py).
"""
from __future__ import annotations

import sys

import torch


def meta_inputs(B, M, steps, *, n_real, block_size, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # some rows start near the end of their block table (the column clamp), one kept nothing
    next_start = torch.randint(0, M * block_size + 2, (B,), generator=g)
    num_valid = torch.randint(0, 5, (B,), generator=g)
    num_valid[0] = 1
    if B > 1:
        num_valid[1] = 0                            # a real row (when n_real > 1) that kept nothing
        next_start[-1] = M * block_size - 1         # its later steps pass the table's end (clamp)
    block_tables = torch.randint(1, 1000, (B, M), generator=g, dtype=torch.int64).to(torch.int32)
    block_tables[n_real:] = 0                       # pads: zeroed block tables (prepare_decode)
    num_real = torch.tensor([n_real])
    return [t.to(device) for t in (next_start, num_valid, num_real, block_tables)]


def meta_oracle(next_start, num_valid, num_real, block_tables, *, steps, block_size, tokens_per_row,
                pads_advance, max_seq=999):
    """The per-step construction the fused proposals used before (``single_token_batch``)."""
    from hybrid_engine.spec.drafters.common import single_token_batch
    B = next_start.shape[0]
    rows = torch.arange(B)
    real = rows < num_real
    valid = (num_valid > 0) & real
    pos = torch.where(real, next_start, 0)
    out = []
    for j in range(steps):
        p = pos + j if pads_advance else torch.where(real, next_start + j, 0)
        fb = single_token_batch(torch.zeros(B, dtype=torch.int64), p, block_tables, block_size,
                                torch.zeros(B, dtype=torch.int64), valid, max_seq)
        out.append((fb.positions, fb.attn.slot_mapping, fb.attn.seq_lens))
    newest = rows * tokens_per_row + (num_valid - 1).clamp(min=0)
    return out, valid, newest


def check_meta(impl, *, B, M, steps, n_real, block_size=16, tokens_per_row=4, pads_advance, seed=0, device="cpu"):
    args = meta_inputs(B, M, steps, n_real=n_real, block_size=block_size, seed=seed, device=device)
    pos, slot, seq_lens, valid, newest = impl(*args, steps=steps, block_size=block_size,
                                              tokens_per_row=tokens_per_row, pads_advance=pads_advance)
    want, want_valid, want_newest = meta_oracle(*[a.cpu() for a in args], steps=steps, block_size=block_size,
                                                tokens_per_row=tokens_per_row, pads_advance=pads_advance)
    assert pos.shape == (steps, B) and pos.dtype == torch.int64 and slot.dtype == torch.int64
    assert seq_lens.dtype == torch.int32 and valid.dtype == torch.bool and newest.dtype == torch.int64
    for j, (p, s, sl) in enumerate(want):
        assert torch.equal(pos[j].cpu(), p), f"step {j} positions {pos[j].tolist()} != {p.tolist()}"
        assert torch.equal(slot[j].cpu(), s), f"step {j} slots {slot[j].tolist()} != {s.tolist()}"
        assert torch.equal(seq_lens[j].cpu(), sl), f"step {j} seq_lens {seq_lens[j].tolist()} != {sl.tolist()}"
    assert torch.equal(valid.cpu(), want_valid), f"valid {valid.tolist()} != {want_valid.tolist()}"
    assert torch.equal(newest.cpu(), want_newest), f"newest {newest.tolist()} != {want_newest.tolist()}"
    return f"valid {int(want_valid.sum())}/{B}"


def argmax_inputs(R, V, *, dtype, seed, special):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 4
    if special:
        for r in range(R):
            kind = r % 5
            if kind == 0 and V > 1:        # a tie within one block: the first index wins
                i, j = sorted(torch.randperm(min(V, 1024), generator=g)[:2].tolist())
                x[r, i] = x[r, j] = x[r].max() + 1
            elif kind == 1 and V > 1024:   # a tie across blocks
                i = int(torch.randint(0, 1024, (1,), generator=g))
                j = int(torch.randint(1024, V, (1,), generator=g))
                x[r, i] = x[r, j] = x[r].max() + 1
            elif kind == 2:                # +inf, then a NaN later: the NaN's index
                i = int(torch.randint(0, V, (1,), generator=g))
                x[r, i] = float("inf")
                x[r, min(V - 1, i + 1 + int(torch.randint(0, 3000, (1,), generator=g)))] = float("nan")
            elif kind == 3:                # -inf everywhere: index 0
                x[r] = float("-inf")
            else:                          # two NaNs: the first
                i, j = sorted(torch.randperm(V, generator=g)[:2].tolist()) if V > 1 else (0, 0)
                x[r, j] = x[r, i] = float("nan")
    return x.to(dtype)


def check_argmax(impl, *, R, V, dtype=torch.float32, special=False, seed=0, device="cpu"):
    x = argmax_inputs(R, V, dtype=dtype, seed=seed, special=special)
    got = impl(x.to(device))
    want = x.float().argmax(-1)
    assert got.dtype == torch.int64 and got.shape == (R,)
    assert torch.equal(got.cpu(), want), f"{got.tolist()} != {want.tolist()}"
    return f"rows {R}"


META_CASES = {
    "mtp_b4_s2_pads": dict(B=4, M=3, steps=2, n_real=3, pads_advance=False),
    "draft_b8_s3_pads": dict(B=8, M=5, steps=3, n_real=6, pads_advance=True, block_size=4),
    "mtp_b1_s1": dict(B=1, M=2, steps=1, n_real=1, pads_advance=False),
    "draft_b3_s5_no_pads": dict(B=3, M=2, steps=5, n_real=3, pads_advance=True, tokens_per_row=6),
}
ARGMAX_CASES = {
    "v16384_f32": dict(R=3, V=16384),
    "v5000_special": dict(R=10, V=5000, special=True),
    "v300_f16_special": dict(R=5, V=300, dtype=torch.float16, special=True),
    "v4097_bf16": dict(R=4, V=4097, dtype=torch.bfloat16, special=True),
    "v1": dict(R=2, V=1),
}
CASES = {**{f"meta_{k}": ("meta", v) for k, v in META_CASES.items()},
         **{f"argmax_{k}": ("argmax", v) for k, v in ARGMAX_CASES.items()}}


def run_case(case, device="cpu", ref=False):
    kind, kw = case
    if kind == "meta":
        from hybrid_engine.step.single_token_steps import single_token_meta_ref, single_token_meta_triton
        return check_meta(single_token_meta_ref if ref else single_token_meta_triton, device=device, **kw)
    from hybrid_engine.step.argmax_rows import argmax_rows_triton
    return check_argmax((lambda x: x.argmax(-1)) if ref else argmax_rows_triton, device=device, **kw)


if __name__ == "__main__":
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpret import case_main
    torch.set_num_threads(1)
    sys.exit(case_main(CASES, sys.argv[1:], run=run_case))
