"""The fused proposals' single-token metadata (``step/single_token_steps.py``): the torch twin and
the Triton kernel (interpreter on CPU) against independent code, the forward batches
``SingleTokenSteps`` builds against ``single_token_batch``'s, and MTP's two input norms written
side by side."""
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from single_token_cases import CASES, META_CASES, check_meta  # noqa: E402
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases  # noqa: E402


@pytest.mark.parametrize("name", sorted(META_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_meta_ref_matches_single_token_batch(name, seed):
    from hybrid_engine.step.single_token_steps import single_token_meta_ref
    check_meta(single_token_meta_ref, seed=seed, **META_CASES[name])


def test_meta_check_catches_a_wrong_slot():
    """The check fails when one slot is off (guards the oracle comparison)."""
    from hybrid_engine.step.single_token_steps import single_token_meta_ref

    def broken(*args, **kw):
        pos, slot, sl, valid, newest = single_token_meta_ref(*args, **kw)
        slot[-1, 0] += 1
        return pos, slot, sl, valid, newest
    with pytest.raises(AssertionError, match="slots"):
        check_meta(broken, **META_CASES["mtp_b4_s2_pads"])


def test_kernels_in_interpreter():
    res = run_cases(HERE / "single_token_cases.py")
    for name in CASES:
        assert_case(res, name)
    assert_compiles_for_sm90(res)       # as launched, the kernels also compile for the GPU


def test_batches_equal_single_token_batch():
    """Each step's ForwardBatch from the shared constants holds single_token_batch's values."""
    from hybrid_engine.spec.drafters.common import single_token_batch
    from hybrid_engine.step.single_token_steps import SingleTokenSteps, single_token_meta
    B, bs = 3, 16
    steps = SingleTokenSteps(8, "cpu")
    bt = torch.randint(1, 50, (B, 4), dtype=torch.int32)
    ns, nv = torch.tensor([5, 40, 63]), torch.tensor([1, 0, 2])
    pos, slot, sl, valid, _ = single_token_meta(ns, nv, torch.tensor([B]), bt, steps=2, block_size=bs,
                                                tokens_per_row=4, pads_advance=True)
    tok = torch.tensor([7, 8, 9])
    for mamba_slots in (None, torch.tensor([4, 5, 6])):
        for j in range(2):
            got = steps.batch(tok, pos[j], sl[j], slot[j], bt, mamba_slots, 77)
            want = single_token_batch(tok, ns + j, bt, bs, torch.zeros(B, dtype=torch.int64)
                                      if mamba_slots is None else mamba_slots, valid, 77)
            for name in ("input_ids", "positions", "logits_indices"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            for name in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
                a, b = getattr(got.attn, name), getattr(want.attn, name)
                assert a.dtype == b.dtype and torch.equal(a, b), name
            assert (got.attn.max_query_len, got.attn.max_seq_len) == (want.attn.max_query_len, want.attn.max_seq_len)
            gm, wm = got.mamba, want.mamba
            assert (gm.num_decode_rows, gm.decode_len, gm.prefill_qsl_cpu) == (wm.num_decode_rows, wm.decode_len,
                                                                               wm.prefill_qsl_cpu)
            for name in ("decode_slots", "num_accepted", "prefill_query_start_loc", "prefill_slots",
                         "has_initial_state"):
                a, b = getattr(gm, name), getattr(wm, name)
                assert a.dtype == b.dtype and torch.equal(a, b), name


def test_mtp_eh_input_equals_the_cat_of_the_norms():
    """MTP's first layer input: the two norms written side by side equal cat(enorm, hnorm)."""
    from hybrid_engine.models.layers import RMSNorm
    from hybrid_engine.models.mtp import MTP
    torch.manual_seed(0)

    class First:
        enorm, hnorm = RMSNorm(8, 1e-5), RMSNorm(8, 1e-5)
    First.enorm.weight.data.uniform_(0.5, 2.0)
    First.hnorm.weight.data.uniform_(-2.0, 2.0)
    e, h = torch.randn(5, 8) * 3, torch.randn(5, 8)
    got = MTP._eh_input(First, e, h)
    want = torch.cat([First.enorm(e), First.hnorm(h)], -1)
    assert torch.equal(got, want)
    assert not torch.equal(got[:, :8], got[:, 8:])
