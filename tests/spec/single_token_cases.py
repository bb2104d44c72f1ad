"""Cases for the fused proposals' single-token metadata (``step/single_token_steps.py``): the
Triton kernel against independent torch code on random inputs. ``single_token_meta``: every
single-token step's positions, slot mapping and lengths, each row's validity and newest-sample
index, against ``spec.drafters.common.single_token_batch`` built step by step as the fused
proposals used to (pads, rows that kept nothing, positions past the block table, both pad rules).

Run as a script (``TRITON_INTERPRET=1``) it prints one ``CASE name OK|FAIL`` line per case;
tests/spec/test_single_token_steps.py runs it and imports ``check_meta`` for the torch twin and
for CUDA (tests/gpu/test_spec_step_graphs.py).
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


META_CASES = {
    "mtp_b4_s2_pads": dict(B=4, M=3, steps=2, n_real=3, pads_advance=False),
    "draft_b8_s3_pads": dict(B=8, M=5, steps=3, n_real=6, pads_advance=True, block_size=4),
    "mtp_b1_s1": dict(B=1, M=2, steps=1, n_real=1, pads_advance=False),
    "draft_b3_s5_no_pads": dict(B=3, M=2, steps=5, n_real=3, pads_advance=True, tokens_per_row=6),
}
CASES = {f"meta_{k}": ("meta", v) for k, v in META_CASES.items()}


def run_case(case, device="cpu", ref=False):
    _, kw = case
    from hybrid_engine.step.single_token_steps import single_token_meta_ref, single_token_meta_triton
    return check_meta(single_token_meta_ref if ref else single_token_meta_triton, device=device, **kw)


if __name__ == "__main__":
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from triton_interpret import case_main
    torch.set_num_threads(1)
    sys.exit(case_main(CASES, sys.argv[1:], run=run_case))
