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

