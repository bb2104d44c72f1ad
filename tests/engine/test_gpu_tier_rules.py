"""tests/gpu/conftest.py's split of the GPU suite, checked by collecting (no GPU needed): the
default tier's rules keep the cases they name under the installed pytest (pytest 9 changed what
``callspec.indices`` holds for stacked ``parametrize`` decorators), and shards are cut after
``-m`` so a tier's parallel processes get equal counts."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = ["tests/gpu/test_kernels.py", "tests/gpu/test_nvfp4_kernels_cuda.py"]


def _collect(marks: str, shard: str | None = None) -> list[str]:
    env = dict(os.environ)
    env.pop("HYBRID_ENGINE_GPU_SHARD", None)
    if shard:
        env["HYBRID_ENGINE_GPU_SHARD"] = shard
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", marks, *FILES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return [line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line]


def test_default_tier_keeps_the_named_cases_and_shards_evenly():
    default = _collect("gpu and not slow")
    slow = set(_collect("gpu")) - set(default)
    assert default and slow
    # _bf16_or_first: every bf16 case, the other dtypes on the first case of the other parameters
    assert "test_nvfp4_relu2_on_load[1x4096x21504-f16]" in default
    assert "test_nvfp4_relu2_on_load[2x4096x21504-f16]" in slow
    assert "test_nvfp4_relu2_on_load[2x4096x21504-bf16]" in default
    assert "test_nvfp4_rows_kernel[4x256-2x4096x4096-f16]" in default
    assert "test_nvfp4_rows_kernel[8x64-2x4096x4096-f16]" in slow
    assert {"test_ssd[0-f32]", "test_ssd[0-f16]", "test_ssd[1-bf16]"} <= set(default)
    assert "test_ssd[1-f32]" in slow
    # _first_and(num_splits=(1, 3, 64)): the first case of the rest, with those three split counts
    splits = sorted(t for t in default if t.startswith("test_attention_splits["))
    assert splits == ["test_attention_splits[0-1]", "test_attention_splits[0-3]", "test_attention_splits[0-64]"]
    shards = [_collect("gpu and not slow", f"{i}/2") for i in range(2)]
    assert sorted(sum(shards, [])) == sorted(default)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
