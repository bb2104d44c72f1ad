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
    assert "test_nvfp4_relu2_on_load[8x4096x21504-bf16]" in default
    assert "test_nvfp4_relu2_on_load[2x4096x21504-bf16]" in slow         # bracketed by 1 and 8 rows
    assert "test_nvfp4_rows_kernel[4x256-2x4096x4096-f16]" in default
    assert "test_nvfp4_rows_kernel[8x64-2x4096x4096-f16]" in slow
    # _bf16_or_first_and_wide_on_first: the second config on the narrow shapes only
    assert "test_nvfp4_rows_kernel[8x64-2x4096x4096-bf16]" in default
    assert "test_nvfp4_rows_kernel[8x64-3x18560x4096-bf16]" in slow
    assert "test_nvfp4_rows_kernel[4x256-3x18560x4096-bf16]" in default
    assert {"test_ssd[0-f32]", "test_ssd[0-f16]", "test_ssd[1-bf16]"} <= set(default)
    assert "test_ssd[1-f32]" in slow
    # _first_and(num_splits=(1, 3, 64)): the first case of the rest, with those three split counts
    splits = sorted(t for t in default if t.startswith("test_attention_splits["))
    assert splits == ["test_attention_splits[0-1]", "test_attention_splits[0-3]", "test_attention_splits[0-64]"]
    shards = [_collect("gpu and not slow", f"{i}/2") for i in range(2)]
    assert sorted(sum(shards, [])) == sorted(default)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shards_spread_a_grid_cycling_its_dtypes():
    """A grid whose dtype cycles with the shard count (three dtypes, three processes) spreads each
    dtype over every shard; every n-th in collection order gave one process all the float32 cases."""
    import importlib.util
    from types import SimpleNamespace
    spec = importlib.util.spec_from_file_location("gpu_conftest", ROOT / "tests" / "gpu" / "conftest.py")
    gpu_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_conftest)
    _shard_members = gpu_conftest._shard_members
    items = [SimpleNamespace(nodeid=f"tests/gpu/test_x.py::test_k[{case}-{dt}]")
             for case in range(60) for dt in ("f32", "bf16", "f16")]
    shards = [_shard_members(items, i, 3) for i in range(3)]
    assert sorted(k for s in shards for k in s) == list(range(len(items)))
    for dt in ("f32", "bf16", "f16"):
        per_shard = [sum(items[k].nodeid.endswith(f"-{dt}]") for k in s) for s in shards]
        assert min(per_shard) >= 10, (dt, per_shard)        # 20 each if even; collection order gave 60 / 0 / 0
