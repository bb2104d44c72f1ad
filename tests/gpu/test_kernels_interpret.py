"""The Triton kernels on CPU through Triton's interpreter (TRITON_INTERPRET=1), tiny float32 cases
(interpret_cases.py), plus the backend dispatch on CPU.  Not marked gpu: runs in CPU CI.

TRITON_INTERPRET must be set before Triton is imported, so the cases run in one subprocess
(about 10 s on 2 cores); skipped when Triton is not installed.
"""
import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mamba_cache.ops import triton_common

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
KERNEL_CASES = ["conv_varlen", "conv_varlen_w2", "conv_update", "conv_update_k8",
                "conv_update_channel_major", "conv_varlen_channel_major", "ssu", "ssu_k0",
                "ssu_out_f16", "ssd", "ssd_odd", "ssd_out_f16", "ssd_fp16_variants", "ssd_pblocks",
                "ssd_sequential", "norm", "linear_fma", "linear_dot",
                "attention_decode", "attention_split", "attention_prefill"]
KERNEL_CASES += ["rmsnorm", "add_rmsnorm", "add_rmsnorm_f16", "relu2", "relu2_f16"]   # models/


@pytest.fixture(scope="module")
def interpreter_results():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    import numpy
    import triton
    ver = lambda v: tuple(int(p) for p in re.findall(r"\d+", v)[:2])   # noqa: E731
    if ver(triton.__version__) < (3, 7) and ver(numpy.__version__) >= (2, 4):
        pytest.skip("triton < 3.7's interpreter breaks with numpy >= 2.4 (notes/mamba-deps.md)")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(HERE / "interpret_cases.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    res = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"CASE (\S+) (OK|FAIL) (.*)", line)
        if m:
            res[m.group(1)] = (m.group(2), m.group(3))
    if not res:
        pytest.fail(f"interpreter run produced no results (rc {proc.returncode}):\n"
                    f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    res["_stderr"] = proc.stderr
    return res


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_in_interpreter(interpreter_results, name):
    assert name in interpreter_results, f"case {name} did not run"
    status, detail = interpreter_results[name]
    assert status == "OK", f"{name}: {detail}\n{interpreter_results['_stderr'][-3000:]}"


# ----------------------------------------------------------------------------- dispatch on CPU

def test_cpu_tensors_use_the_reference(monkeypatch, caplog):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)
    triton_common._logged.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        assert triton_common.kernel_backend("gated_rmsnorm", torch.device("cpu")) == "torch_ref"
        assert triton_common.kernel_backend("gated_rmsnorm", torch.device("cpu")) == "torch_ref"
    msgs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gated_rmsnorm")]
    assert msgs == ["gated_rmsnorm backend on cpu: torch_ref"]


def test_cuda_without_triton_warns_loudly(monkeypatch, caplog):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)
    monkeypatch.setattr(triton_common, "_triton_ok", False)
    triton_common._logged.clear()
    with caplog.at_level(logging.INFO, logger="hybrid_engine"):
        assert triton_common.kernel_backend("ssd_scan_varlen", torch.device("cuda")) == "torch_ref"
    warns = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warns and "Triton missing" in warns[0].getMessage()


def test_env_forces_reference(monkeypatch):
    monkeypatch.setenv("HYBRID_ENGINE_KERNELS", "torch")
    assert triton_common.kernel_backend("ssd_scan_varlen", torch.device("cuda")) == "torch_ref"
    from hybrid_engine.attention.ops import _backend_for
    assert _backend_for(torch.device("cuda")) == "torch_ref"
