import gc
import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# An engine on CUDA sizes its KV cache as a fraction of the device's free memory (half, by
# default): with several pytest processes on one GPU (tests/gpu/run_all.sh) the first engine would
# take ~40 GB and a later one in another process could run out of memory. The test models are tiny:
# cap each CUDA engine's KV budget instead (it also spares every engine zeroing tens of GB). A CPU
# engine's budget is its config's kv_cache_bytes, left as the test set it.
KV_BUDGET_CAP_BYTES = 4 << 30


@pytest.fixture(autouse=True, scope="session")
def _capped_kv_budget():
    from hybrid_engine import device_side
    uncapped = device_side._kv_budget

    def capped(cfg) -> int:
        budget = uncapped(cfg)
        return min(budget, KV_BUDGET_CAP_BYTES) if cfg.device.type == "cuda" else budget
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(device_side, "_kv_budget", capped)
        yield


@pytest.fixture(autouse=True, scope="module")
def _release_gpu_memory_after_module():
    """Several pytest processes may share the GPU (``run_all.sh``), and an engine sizes its KV
    cache from the device's free memory: hand each module's cached blocks back so the other
    processes see them (and every module starts from the same free memory)."""
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """Tiny O(1)-scale Nemotron-H checkpoints written by transformers (the reference)."""
    from hybrid_engine.models.synthetic import make_hf_model
    root = tmp_path_factory.mktemp("models")
    cache = {}

    def get(name: str, **kw):
        if name not in cache:
            cache[name] = make_hf_model(root / name, **kw)
        return cache[name]
    return get


@pytest.fixture(scope="session")
def hybrid_dir(model_dirs):
    """The engine-core test model: Mamba, attention, MLP and MoE blocks, plus MTP weights (which
    transformers ignores, so its greedy reference is unchanged)."""
    return model_dirs("hybrid", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)

