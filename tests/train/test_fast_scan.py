"""benchmarks/train/fast_scan.py: the training scan computes transformers' Nemotron-H chunked scan
(values, final state and gradients of every input), with and without an initial state, padded and
unpadded lengths, several heads per group; and ``training_scan`` swaps it in only inside its block."""
import math

import pytest
import torch

from benchmarks.train.fast_scan import chunk_scan, training_scan

modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")


def _inputs(b, T, h, p, g, n, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float32)  # noqa: E731
    return dict(hidden_states=r(b, T, h, p), dt=r(b, T, h), A=-2 * torch.rand(h, generator=gen),
                B=r(b, T, g, n), C=r(b, T, g, n), D=r(h), dt_bias=r(h), initial_states=r(b, h, p, n))


@pytest.mark.parametrize("b,T,h,p,g,n,L", [(2, 37, 4, 3, 2, 5, 8), (1, 64, 6, 4, 3, 2, 16), (3, 5, 2, 2, 1, 3, 8),
                                           (1, 40, 4, 8, 1, 16, 40)])
@pytest.mark.parametrize("with_init", [False, True])
def test_values_and_gradients_equal_transformers(b, T, h, p, g, n, L, with_init):
    base = _inputs(b, T, h, p, g, n, seed=T + h)
    if not with_init:
        base["initial_states"] = None
    results = []
    for fn in (modeling.mamba2_chunk_scan, chunk_scan):
        args = {k: (v.clone().requires_grad_(True) if v is not None else None) for k, v in base.items()}
        y, final = fn(chunk_size=L, dt_softplus=True, dt_limit=(0.05, math.inf), return_final_states=True, **args)
        gen = torch.Generator().manual_seed(1)
        w_y, w_f = torch.randn(y.shape, generator=gen), torch.randn(final.shape, generator=gen)
        ((y * w_y).sum() + (final * w_f).sum()).backward()
        grads = {k: v.grad for k, v in args.items() if v is not None}
        results.append((y.detach(), final.detach(), grads))
    (y_ref, f_ref, g_ref), (y, f, g_ours) = results
    assert y.shape == y_ref.shape == (b, T, h, p) and f.shape == (b, h, p, n)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(f, f_ref, rtol=1e-4, atol=1e-4)
    assert g_ours.keys() == g_ref.keys()
    for k in g_ref:
        torch.testing.assert_close(g_ours[k], g_ref[k], rtol=1e-4, atol=2e-4, msg=k)


def test_initial_state_and_final_state_matter():
    """A scan over two halves, the second starting from the first's final state, equals one scan."""
    a = _inputs(2, 48, 4, 4, 2, 8, seed=5)
    kw = dict(A=a["A"], D=a["D"], dt_bias=a["dt_bias"], dt_softplus=True, chunk_size=16,
              return_final_states=True)
    whole, f_whole = chunk_scan(a["hidden_states"], a["dt"], B=a["B"], C=a["C"], **kw)
    first, f_first = chunk_scan(a["hidden_states"][:, :20], a["dt"][:, :20], B=a["B"][:, :20], C=a["C"][:, :20], **kw)
    second, f_second = chunk_scan(a["hidden_states"][:, 20:], a["dt"][:, 20:], B=a["B"][:, 20:], C=a["C"][:, 20:],
                                  initial_states=f_first, **kw)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(f_second, f_whole, rtol=1e-4, atol=1e-4)
    assert (second - whole[:, 20:]).abs().max() < 1e-3
    no_init = chunk_scan(a["hidden_states"][:, 20:], a["dt"][:, 20:], B=a["B"][:, 20:], C=a["C"][:, 20:],
                         **{**kw, "return_final_states": False})
    assert (no_init - second).abs().max() > 1e-2


def test_gate_and_packed_sequences_refused():
    a = _inputs(1, 8, 2, 2, 1, 2, seed=0)
    with pytest.raises(ValueError, match="gate z"):
        chunk_scan(a["hidden_states"], a["dt"], a["A"], a["B"], a["C"], 8, z=a["hidden_states"])
    with pytest.raises(ValueError, match="packed sequences"):
        chunk_scan(a["hidden_states"], a["dt"], a["A"], a["B"], a["C"], 8, seq_idx=torch.zeros(1, 8, dtype=torch.int32))


def test_float32_under_autocast():
    """Under bf16 autocast (as bench-large trains) the scan still computes in float32."""
    a = _inputs(2, 40, 4, 8, 2, 16, seed=9)
    kw = dict(chunk_size=16, dt_softplus=True, return_final_states=True)
    y, f = chunk_scan(**a, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ac, f_ac = chunk_scan(**a, **kw)
    assert y_ac.dtype == torch.float32 and torch.equal(y_ac, y) and torch.equal(f_ac, f)


def test_swapped_in_for_a_training_forward(monkeypatch):
    """A Nemotron-H model's training forward calls chunk_scan inside training_scan() (and
    transformers' own scan outside it): the swap reaches the mixers, not only the module name."""
    from benchmarks.train import fast_scan
    from benchmarks.train.models import PRESETS, draft_model, hf_config_for
    calls = []

    def spy(*args, **kw):
        calls.append(1)
        return chunk_scan(*args, **kw)
    monkeypatch.setattr(fast_scan, "chunk_scan", spy)
    torch.manual_seed(0)
    model = draft_model(hf_config_for(PRESETS["tiny"].draft, 64, mtp=False)).train()
    ids = torch.randint(3, 64, (2, 20))
    with training_scan():
        model(input_ids=ids).logits.sum().backward()
    assert calls, "the mixers did not call the swapped-in scan"
    n = len(calls)
    model(input_ids=ids)
    assert len(calls) == n


def test_training_scan_swaps_only_inside_the_block():
    original = modeling.mamba2_chunk_scan
    with training_scan():
        assert modeling.mamba2_chunk_scan is chunk_scan
    assert modeling.mamba2_chunk_scan is original
    with pytest.raises(RuntimeError), training_scan():
        raise RuntimeError("boom")
    assert modeling.mamba2_chunk_scan is original


def test_a_transformers_without_the_scan_function_keeps_its_own(monkeypatch, caplog):
    from benchmarks.train import fast_scan
    monkeypatch.delattr(modeling, "mamba2_chunk_scan")
    monkeypatch.setattr(fast_scan, "_warned", [])
    with caplog.at_level("WARNING", logger="benchmarks.train"):
        with training_scan():
            assert not hasattr(modeling, "mamba2_chunk_scan")
        with training_scan():
            pass
    assert sum("mamba2_chunk_scan" in r.getMessage() for r in caplog.records) == 1
