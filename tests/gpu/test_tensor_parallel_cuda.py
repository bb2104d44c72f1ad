"""Tensor parallelism on two GPUs (NCCL, CUDA graphs per rank): TP=2 gives the greedy tokens of
TP=1 and of transformers (float32), with and without speculation, and launches its decode steps
with no host sync on rank 0 or rank 1. Each engine runs in its own process (``tp_case.py``: one
CUDA tensor-parallel engine per process). The fused all-reduce + add + RMSNorm kernel is checked
on one GPU (the peers' side staged by hand) and between the two (``tp_allreduce_case.py``)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hf_reference import hf_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from allreduce_norm_cases import CASES, check  # noqa: E402

pytestmark = [pytest.mark.gpu]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")

CASE = Path(__file__).resolve().parent / "tp_case.py"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("gpu_tp", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1, vocab_size=251)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(2)
    return [rng.integers(3, 250, n).tolist() * 2 for n in (1, 9, 30, 4, 17, 2)]


def run_case(target, prompts, method, tp, dtype, *extra, env=None):
    env = {**os.environ, "TP_CASE_PROMPTS": json.dumps(prompts),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    res = subprocess.run([sys.executable, str(CASE), str(target), method, str(tp), dtype, *extra], env=env,
                         capture_output=True, text=True, timeout=240)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert res.returncode == 0 and lines, f"case failed (rc {res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-6000:]}"
    fused = [ln for ln in res.stdout.splitlines() if ln.startswith("FUSED ")]
    if tp > 1:      # the engine took the path the environment asks for (fused unless turned off)
        off = (env or {}).get("HYBRID_ENGINE_TP_FUSED_NORM") == "0"
        assert fused == [f"FUSED {int(not off)}"], f"fused all-reduce + norm: {fused}, turned off: {off}"
    return json.loads(lines[-1][len("TOKENS "):])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("name", sorted(CASES))
def test_allreduce_norm_kernel_one_gpu(name):
    check(**CASES[name], device="cuda")


@two_gpus
def test_allreduce_norm_kernel_two_gpus():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(Path(__file__).resolve().parent / "tp_allreduce_case.py")],
                         env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0 and "OK" in res.stdout.split(), f"{res.stdout[-3000:]}\n{res.stderr[-6000:]}"


@two_gpus
@pytest.mark.parametrize("method", ["none", "mtp", "ngram"])
def test_tp2_equals_tp1_and_transformers(target, prompts, method):
    want = hf_greedy(target, prompts, 16)
    assert run_case(target, prompts, method, 1, "float32") == want
    assert run_case(target, prompts, method, 2, "float32") == want


@two_gpus
def test_tp2_fused_norm_off_equals_transformers(target, prompts):
    """The unfused path (NCCL, then the norm kernel) stays correct for prefill-sized steps."""
    want = hf_greedy(target, prompts, 16)
    assert run_case(target, prompts, "none", 2, "float32", env={"HYBRID_ENGINE_TP_FUSED_NORM": "0"}) == want


@two_gpus
def test_tp2_steps_launch_without_host_sync(target, prompts):
    tokens = run_case(target, prompts, "none", 2, "bfloat16", "sync", env={"HYBRID_ENGINE_TP_SYNC_DEBUG": "error"})
    assert len(tokens) == len(prompts) and all(len(t) == 16 for t in tokens)


@two_gpus
def test_tp2_one_group_split_over_ranks(model_dirs, prompts):
    """One B / C group over two ranks (SplitGroupGatedNorm: the gated norm's NCCL all-reduce
    captured in the decode graphs, the decode SSU kernel without its fused norm): transformers'
    tokens, with MTP drafts."""
    target = model_dirs("gpu_tp_one_group", pattern="M*-M-ME*", n_groups=1, seed=9, num_nextn_predict_layers=1)
    want = hf_greedy(target, prompts, 16)
    assert run_case(target, prompts, "mtp", 2, "float32") == want
