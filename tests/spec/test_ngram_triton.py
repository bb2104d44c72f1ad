"""The n-gram drafter's Triton kernel (spec/drafters/triton_ngram.py) against its torch path on CPU,
through Triton's interpreter, plus the backend choice. Not marked gpu: runs in CPU CI.

TRITON_INTERPRET must be set before Triton is imported, so the cases (ngram_triton_cases.py:
random multi-step runs comparing drafts, history and lengths) run in one subprocess (~15 s on
2 cores); skipped when Triton is not installed. tests/gpu/test_ngram_cuda.py runs them on CUDA.
"""
import logging
import sys
from pathlib import Path

import pytest
import torch

from hybrid_engine.mamba_cache.ops import triton_common
from hybrid_engine.spec.drafters import ngram
from hybrid_engine.spec.drafters.ngram import NgramDrafter

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from triton_interpret import assert_case, assert_compiles_for_sm90, run_cases  # noqa: E402
sys.path.insert(0, str(HERE))
from ngram_triton_cases import CASES  # noqa: E402


@pytest.fixture(scope="module")
def interpreter_results():
    return run_cases(HERE / "ngram_triton_cases.py")


@pytest.mark.parametrize("name", list(CASES))
def test_triton_ngram_in_interpreter(interpreter_results, name):
    assert_case(interpreter_results, name)


def test_launched_kernels_compile_for_sm90(interpreter_results):
    """The kernels as the cases launched them also compile for the GPU (the interpreter skips
    the compiler's checks)."""
    assert_compiles_for_sm90(interpreter_results)


# ------------------------------------------------------------------------------- backend choice

def bare(device: str) -> NgramDrafter:
    """A drafter object with only its device set (no device tensors: 'cuda' works on CPU hosts)."""
    d = NgramDrafter.__new__(NgramDrafter)
    d.device = torch.device(device)
    return d


def test_cpu_auto_is_torch_and_logged_once(monkeypatch, caplog):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)
    triton_common._logged.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        a = NgramDrafter(2, 1, 3, num_slots=2, max_len=8, device="cpu")
        b = NgramDrafter(2, 1, 3, num_slots=2, max_len=8, device="cpu", backend="auto")
    assert a.backend == b.backend == "torch" and a._kernel is None
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ngram_propose")]
    assert msgs == ["ngram_propose backend on cpu: torch_ref"]


def test_cuda_auto_is_triton_unless_forced_or_missing(monkeypatch, caplog):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)
    monkeypatch.setattr(triton_common, "_triton_ok", True)
    assert bare("cuda")._choose_backend("auto") == "triton"
    monkeypatch.setenv("HYBRID_ENGINE_KERNELS", "torch")
    assert bare("cuda")._choose_backend("auto") == "torch"
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS")
    monkeypatch.setattr(triton_common, "_triton_ok", False)
    triton_common._logged.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        assert bare("cuda")._choose_backend("auto") == "torch"
    assert any(r.levelno >= logging.WARNING and "Triton missing" in r.getMessage() for r in caplog.records)


def test_explicit_backends(monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend must be one of"):
        bare("cpu")._choose_backend("cuda")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        bare("cpu")._choose_backend("triton")
    ngram._logged.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        assert bare("cpu")._choose_backend("torch") == "torch"
        assert bare("cpu")._choose_backend("torch") == "torch"
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert bare("cpu")._choose_backend("triton") == "triton"      # no Triton import here
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ngram_propose")]
    assert msgs == ["ngram_propose backend on cpu: torch (requested)",
                    "ngram_propose backend on cpu: triton (requested)"]
