"""Serving never recompiles a Triton kernel because of an argument's value: every per-step count,
offset and metadata pointer of the step path's kernels is excluded from Triton's value
specialisation (``do_not_specialize``, ``do_not_specialize_on_alignment``), and binary-search
depths do not follow the step's sequence count. Otherwise each new combination (a token count
that is a multiple of 16, a sequence-offset view that is 16-byte aligned, a step with one
sequence) compiles a new variant in the middle of serving: ~0.3-0.6 s each, 73 of them in the
first minute of an 8B chat benchmark after its warm-up, on a fresh Triton cache (2026-11-27).
The check runs in its own process (kernel_variants_case.py): Triton's caches are per process
and other tests launch on misaligned views on purpose. Not covered: model widths that put the
per-step offset views of the in-projection off 16-byte alignment (this model's are aligned), and
the FP8 / NVFP4 kernels."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_serving_compiles_each_kernel_once_per_constexprs(model_dirs):
    model = model_dirs("gpu_kernel_variants", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)
    case = Path(__file__).with_name("kernel_variants_case.py")
    proc = subprocess.run([sys.executable, str(case), str(model)], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["kernels"] >= 10, got          # the workload really launched the step path's kernels
    assert got["recompiled"] == {}, json.dumps(got["recompiled"], indent=1)
    assert got["search_depths"] and all(len(v) == 1 for v in got["search_depths"].values()), got["search_depths"]
