"""benchmarks/train on CUDA: a ``--preset tiny`` run trains with transformers' PyTorch Mamba2 path
(no mamba-ssm needed) and its saved folders score the same held-out loss in transformers and in
our engine's CUDA kernels (float32, TF32 off for the comparison)."""
import json

import pytest

pytestmark = pytest.mark.gpu


def test_tiny_run_on_cuda(tmp_path):
    from benchmarks.train.__main__ import main
    assert main(["--preset", "tiny", "--device", "cuda", "--out", str(tmp_path), "--no-progress",
                 "--max-steps", "6"]) == 0
    r = json.loads((tmp_path / "train_report.json").read_text())
    assert r["device"].startswith("cuda") and r["steps"] == 6
    h = r["heldout_loss"]
    for m in ("target", "draft"):
        assert h["engine"][m] == pytest.approx(h["transformers"][m], abs=2e-3), m
    assert h["engine"]["mtp"] == pytest.approx(h["training_modules"]["mtp"], abs=2e-3)
