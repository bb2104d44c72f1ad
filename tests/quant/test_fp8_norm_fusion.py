"""The block norm quantizing its output for FP8 projections (``RMSNorm.add_norm_for``,
``fp8.Fp8Rows``) gives the same tokens and logprobs as the norm followed by each projection's own
quantizer, end to end on the CPU (Triton's interpreter runs the norm kernel; norm_fusion_case.py
forces the W8A8 path that CUDA takes for prefill-sized steps). The same check on CUDA:
tests/gpu/test_quant_cuda.py::test_fp8_norm_fusion_keeps_the_logits."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_norm_fusion_keeps_tokens_and_logprobs():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("norm_fusion_case.py"))], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["fused_calls"] > 0, res          # the fused norm ran (else the comparison proves nothing)
    assert res["plain_calls"] == 0, res
    assert res["equal"], res
    # the choice is logged once
    assert res["logged"] == ["FP8 W8A8 prefill: the block RMSNorm writes FP8 rows for its projections (width 256)"], \
        res["logged"]
