"""Prefix caching on CUDA: caching on == off with CUDA graphs (and MTP graphs), and no host sync
on steps that restore and save Mamba checkpoints (docs/design.md invariants 8 and 13)."""
import numpy as np
import pytest

from engine_steps import launch_steps_without_sync
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("gpu_prefix", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)


def chat(llm, rng):
    system = rng.integers(3, 256, 37).tolist()
    hist = [list(system) for _ in range(3)]
    out = []
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    for _ in range(3):
        prompts = [h + rng.integers(3, 256, int(rng.integers(2, 9))).tolist() for h in hist]
        res = llm.generate(prompts, sp, use_tqdm=False)
        hist = [p + o.outputs[0].token_ids for p, o in zip(prompts, res)]
        out.append([(o.outputs[0].token_ids, o.num_cached_tokens) for o in res])
    return out


@pytest.mark.parametrize("method", [None, "mtp", "draft_model"])
def test_caching_on_equals_off_with_graphs(target, method):
    spec = None if method is None else SpeculativeConfig(method, 2, model=str(target) if method == "draft_model"
                                                          else None)
    runs = {}
    for on in (False, True):
        llm = LLM(target, dtype="float32", device="cuda", max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                  num_kv_blocks=128, speculative_config=spec, enable_prefix_caching=on, mamba_checkpoint_interval=2)
        runs[on] = chat(llm, np.random.default_rng(0))
        st = llm.engine.stats(expert_load=False)
        assert st["free_blocks"] == st["total_blocks"]
    assert [[t for t, _ in turn] for turn in runs[True]] == [[t for t, _ in turn] for turn in runs[False]]
    assert sum(c > 0 for turn in runs[True] for _, c in turn) >= 3


def test_restoring_and_saving_steps_never_sync_the_host(target):
    llm = LLM(target, dtype="bfloat16", device="cuda", max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
              num_kv_blocks=128, enable_prefix_caching=True, mamba_checkpoint_interval=2)
    eng = llm.engine
    rng = np.random.default_rng(1)
    system = rng.integers(3, 256, 40).tolist()
    llm.generate([system + [5, 6]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)   # publishes
    for _ in range(3):
        eng.add_request(eng.make_request(system + rng.integers(3, 256, 30).tolist(),
                                         SamplingParams(max_tokens=1000, ignore_eos=True)))
    launch_steps_without_sync(eng, 12)        # restores, chunks that save, decode steps
    assert eng.stats(expert_load=False)["prefix_cache_hits"] == 3
    for r in list(eng.scheduler.running):
        eng.abort(r.request_id)
