"""Issue 17's quality goals on a trained model (the embedded default target): held-out loss of FP8
within 1% of bf16's, NVFP4 within 5% (benchmarks/quant_quality.py, 16 windows; a larger run is in
benchmarks/results/2026-11-27-quant-quality-default-cpu.md)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def test_quantized_held_out_loss_within_the_goals(tmp_path):
    from benchmarks.quant_quality import GOALS, measure
    res = measure(("bf16", "fp8", "fp8-online", "nvfp4"), windows=16, seq_len=256, prompts=2, max_tokens=8,
                  work=tmp_path)
    rows = res["variants"]
    assert res["scored_tokens"] == 16 * 256
    for v, goal in GOALS.items():
        assert rows[v]["loss_ratio"] <= goal, (v, rows[v]["loss"], rows["bf16"]["loss"])
        # the format really ran: its weights are not bf16's, so neither is its loss
        assert rows[v]["loss"] != rows["bf16"]["loss"], v
    # 4-bit codes lose more than 8-bit ones. 16 windows, not 4: on 4 (1,024 tokens) the retrained
    # default model's NVFP4 loss came out 0.05% above bf16's and FP8's 0.17% (on 16: 0.56% and 0.03%)
    assert rows["nvfp4"]["loss"] > rows["fp8"]["loss"]
    assert (tmp_path / "nvfp4" / "config.json").exists() and (tmp_path / "fp8" / "config.json").exists()
