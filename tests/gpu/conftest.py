"""tests/gpu: make the case tables here (kernel_cases, interpret_cases) importable, and split the
GPU suite into two tiers.

Default tier, ``python -m pytest -q -m "gpu and not slow"``: every kernel, every launch-option
family, every graph family and the no-host-sync checks, each on representative cases, in a few
minutes on one H100 (the number is in README.md). The ``slow`` tier holds the rest of each sweep
(every dtype x case, every K, every variant x case); ``tests/gpu/run_all.sh`` runs both.

The split lives in one table, ``DEFAULT_TIER`` below, instead of marks spread over the files: a
sweep's case stays in the default tier when its rule says so, and is marked ``slow`` otherwise.
Tests not named in the table are default-tier unless they mark themselves slow.
"""
import os
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

_BF16_NAMES = (torch.bfloat16, "bfloat16", "bf16")


def _same(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:           # values whose == is not a truth value (arrays, tensors)
        return False


def param_indices(item) -> dict[str, int]:
    """Each parametrized argument of ``item`` -> the position of its value in its own
    ``parametrize`` list. Not ``callspec.indices``: pytest 9 numbers the arguments of stacked
    ``parametrize`` decorators by the item's position in the whole grid (a test's second f16 case
    read as index 1 for every argument, so ``_bf16_or_first`` dropped every f16 case but the
    grid's first), where pytest 8 gave each decorator's own position. Arguments not found in the
    marks keep ``callspec.indices``."""
    from _pytest.mark.structures import ParameterSet
    cs = item.callspec
    out = dict(cs.indices)
    for mark in item.iter_markers("parametrize"):
        names = mark.args[0] if mark.args else mark.kwargs["argnames"]
        values = mark.args[1] if len(mark.args) > 1 else mark.kwargs["argvalues"]
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
        if not all(n in cs.params for n in names):
            continue
        want = [cs.params[n] for n in names]
        for i, v in enumerate(values):
            v = list(v.values) if isinstance(v, ParameterSet) else [v] if len(names) == 1 else list(v)
            if len(v) == len(want) and all(_same(a, b) for a, b in zip(v, want)):
                out.update((n, i) for n in names)
                break
    return out


def _bf16_or_first(item) -> bool:
    """Every case in bf16 (the serving dtype); f32 and f16 only on the first case of every other
    parameter (one compile each, which is where dtype bugs show)."""
    if item.callspec.params.get("dtype") in _BF16_NAMES:
        return True
    return all(i == 0 for name, i in param_indices(item).items() if name != "dtype")


def _first_and(**keep):
    """The first value of each parameter, plus the listed values of the named ones."""
    def rule(item) -> bool:
        cs = item.callspec
        for name, i in param_indices(item).items():
            allowed = keep.get(name)
            if i != 0 and not (allowed is not None and cs.params[name] in allowed):
                return False
        return True
    return rule


def _bf16_or_first_and_wide_on_first(*narrow_shapes: int):
    """``_bf16_or_first``, with the configs after the first only on the shapes at the listed
    positions: each config compiles once on a narrow shape; the wide shapes (seconds each) run
    on the first config only."""
    def rule(item) -> bool:
        at = param_indices(item)
        return _bf16_or_first(item) and (at["config"] == 0 or at["shape"] in narrow_shapes)
    return rule


# test function name -> rule(item) -> True if the case stays in the default tier
DEFAULT_TIER = {
    # test_kernels.py
    "test_conv_varlen": _bf16_or_first,
    "test_conv_update": _bf16_or_first,
    "test_conv_update_all_k": lambda it: it.callspec.params["K"] in (0, 1, 3, 8),
    # every variant once, on the smallest case; the variant x case grid is slow
    "test_conv_update_variants": lambda it: it.callspec.params["case"] == 1,
    "test_conv_update_variant_dtypes_all_k": lambda it: it.callspec.id == "cols-bf16",
    "test_conv_update_variant_widths": lambda it: it.callspec.params["weight_load"] == "taps",
    "test_ssd": _bf16_or_first,
    "test_ssd_variants": _bf16_or_first,
    "test_ssd_options": _bf16_or_first,
    "test_ssu_all_k": lambda it: it.callspec.params["K"] in (0, 1, 3, 8) and _bf16_or_first(it)
                                 or it.callspec.params["K"] == 3,
    "test_ssu": _bf16_or_first,
    "test_norm": _bf16_or_first,
    "test_norm_launch_options": _bf16_or_first,
    "test_attention": _bf16_or_first,
    "test_attention_splits": _first_and(num_splits=(1, 3, 64)),
    # test_fp8_kv_cuda.py
    "test_attention_fp8_kv": _bf16_or_first,
    "test_attention_fp8_kv_splits": _first_and(num_splits=(1, 3, 64)),
    # test_skinny_linear_cuda.py
    "test_skinny_linear": _bf16_or_first,
    "test_skinny_linear_relu2_on_load": _bf16_or_first,
    # test_quant_cuda.py and test_nvfp4_kernels_cuda.py: the quantized kernels' sweeps (together
    # 600 of the tier's 1,517 s of test time on an H200, 2026-11-29, before this rule). Float16's
    # own ranges keep their full sweeps in the default tier: test_nvfp4_fma_kernel_x_range and
    # test_nvfp4_decode_is_exact_for_every_code_and_scale
    "test_fp8_skinny_kernel": _bf16_or_first,
    "test_fp8_skinny_relu2_on_load": _bf16_or_first,
    "test_fp8_experts": _bf16_or_first,
    "test_fp8_experts_w8a8": _bf16_or_first,
    # the 2-row wide case is slow: 1 and 8 rows bracket it (7 s on an H200)
    "test_nvfp4_relu2_on_load": lambda it: _bf16_or_first(it) and param_indices(it)["shape"] != 2,
    "test_nvfp4_kernel": _bf16_or_first,
    "test_nvfp4_dot_kernel_at_the_rule": _bf16_or_first,
    "test_nvfp4_dot_kernel_k_slices": _bf16_or_first,
    "test_nvfp4_fma_kernel_one_row": _bf16_or_first_and_wide_on_first(0, 3, 4),
    "test_nvfp4_rows_kernel": _bf16_or_first_and_wide_on_first(0, 3, 4, 6),
    "test_nvfp4_experts": _bf16_or_first,
    # test_kernels_ssu_norm.py
    "test_ssu_norm_all_k": lambda it: it.callspec.params["K"] in (0, 3) or
                                      (it.callspec.params["K"] == 8 and _bf16_or_first(it)),
    "test_ssu_norm": _bf16_or_first,
    "test_deferred_state_update_is_bitwise_the_checkpointed": _bf16_or_first,
    "test_ssu_norm_launch_options": lambda it: param_indices(it)["block_p"] in (0, 2),
    # test_rmsnorm_cuda.py: cheap, but 114 cases
    "test_rmsnorm_triton_matches_ref": _bf16_or_first,
    "test_fused_add_rmsnorm_matches_ref": _bf16_or_first,
}


@pytest.hookimpl(hookwrapper=True)
def pytest_collection_modifyitems(config, items):
    # a wrapper: the slow marks go on before the other implementations run (``-m`` deselects by
    # them there), and the shard is cut after, from the items left, so the shards of a tier get
    # equal counts. Cut before -m, the default tier's three processes got 304 / 213 / 205 tests and
    # took 429 / 288 / 307 s (H200, 2026-11-29)
    slow = pytest.mark.slow
    here = Path(__file__).resolve().parent
    for item in items:
        if here not in Path(str(item.path)).resolve().parents:
            continue            # the hook sees the whole session's items; the table is for tests/gpu
        rule = DEFAULT_TIER.get(getattr(item, "originalname", item.name))
        if rule is not None and hasattr(item, "callspec") and not rule(item):
            item.add_marker(slow)
    yield
    shard = os.environ.get("HYBRID_ENGINE_GPU_SHARD")
    if shard:                   # "i/n": one n-th of the items (the slow tier takes ~35 min)
        i, n = _parse_shard(shard)
        mine = _shard_members(items, i, n)
        config.hook.pytest_deselected(items=[it for k, it in enumerate(items) if k not in mine])
        items[:] = [it for k, it in enumerate(items) if k in mine]


def _shard_members(items, i: int, n: int) -> set[int]:
    """Positions of shard ``i`` of ``n``: every n-th item in the order of a stable hash of the
    test ids, so the counts differ by at most one. Not every n-th in collection order: parametrize
    grids cycle their dtypes with period 3, so with 3 processes every float32 case of a grid went
    to one process (the default tier's three took 433 / 437 / 486 s, H200, 2026-11-29)."""
    order = sorted(range(len(items)), key=lambda k: (zlib.crc32(items[k].nodeid.encode()), k))
    return {k for rank, k in enumerate(order) if rank % n == i}


def replay_log(monkeypatch, plan_cls) -> list[bool]:
    """Per step the runner executes, whether a fused plan of ``plan_cls`` replayed it (the spy
    sits on the runner's ``execute`` and on the plan's ``replay``)."""
    from hybrid_engine.step import runner as runner_mod
    log, took = [], [False]
    orig_replay, orig_exec = plan_cls.replay, runner_mod.ModelRunner.execute

    def spy_replay(self, *a, **k):
        took[0] = True
        return orig_replay(self, *a, **k)

    def spy_exec(self, sched):
        took[0] = False
        handle = orig_exec(self, sched)
        log.append(took[0])
        return handle
    monkeypatch.setattr(plan_cls, "replay", spy_replay)
    monkeypatch.setattr(runner_mod.ModelRunner, "execute", spy_exec)
    return log


@pytest.fixture(scope="module")
def target(model_dirs):
    """The engine tests' model (test_engine_cuda, test_fp8_kv_cuda): Mamba, attention, MLP and MoE
    blocks with an MTP layer. A module that needs another defines its own ``target``."""
    return model_dirs("gpu_target", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)


@pytest.fixture(scope="module")
def prompts():
    """Eight prompts of 1-40 tokens for ``target`` (a module may define its own)."""
    rng = np.random.default_rng(3)
    return [rng.integers(3, 256, n).tolist() for n in [1, 5, 17, 40, 9, 33, 12, 3]]


@pytest.fixture
def spec_step_log(monkeypatch):
    """``replay_log`` of the fused verify-step plans (``SpecStepGraphs``: n-gram or MTP)."""
    from hybrid_engine.step.spec_graphs import SpecStepGraphs
    return replay_log(monkeypatch, SpecStepGraphs)


@pytest.fixture
def graph_path_log(monkeypatch):
    """``replay_log`` of the fused greedy step plan (``GreedyStepGraphs``)."""
    from hybrid_engine.step.greedy_graphs import GreedyStepGraphs
    return replay_log(monkeypatch, GreedyStepGraphs)


def pytest_runtest_logreport(report):
    """``HYBRID_ENGINE_TEST_TIMES=path``: append "seconds phase:outcome nodeid" per test as it ends
    (and per slow or failed setup/teardown),
    so a run stopped by a time limit still says which tests took the time."""
    path = os.environ.get("HYBRID_ENGINE_TEST_TIMES")
    if path and (report.when == "call" or report.outcome != "passed" or report.duration > 1.0):
        with open(path, "a") as f:
            f.write(f"{report.duration:8.2f} {report.when}:{report.outcome} {report.nodeid} @{time.time():.0f}\n")


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"HYBRID_ENGINE_GPU_SHARD must be 'i/n' with 0 <= i < n, got {text!r}") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"HYBRID_ENGINE_GPU_SHARD must be 'i/n' with 0 <= i < n, got {text!r}")
    return i, n
