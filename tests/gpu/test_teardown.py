"""An engine that is dropped gives all its GPU memory back (CUDA graphs, drafter caches included):
a server or soak that builds engines in turn must not pile them up."""
import asyncio
import gc

import pytest
import torch

from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.async_llm import AsyncLLM

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target(model_dirs):
    return model_dirs("gpu_teardown", pattern="M-M*-ME*", seed=1, num_nextn_predict_layers=1)


def _use_async(eng):
    async def go():
        for rid, p in (("a", [5, 6, 7, 8]), ("b", [9] * 20)):
            async for _ in eng.generate(p, SamplingParams(max_tokens=8, ignore_eos=True), request_id=rid):
                pass
        eng.shutdown()
    asyncio.run(go())


@pytest.fixture(scope="module")
def warm(target):
    """Process-wide allocations made once on first use (the cuBLAS workspace: 32 MiB on an H100)
    are not the engine's: build, use and drop one engine before measuring."""
    llm = LLM(target, dtype="bfloat16", device="cuda", max_num_seqs=8, num_kv_blocks=256)
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    del llm
    gc.collect()


@pytest.mark.parametrize("api", ["LLM", "AsyncLLM"])
@pytest.mark.parametrize("method", [None, "ngram", "draft_model", "mtp"])
def test_dropped_engine_frees_its_gpu_memory(target, warm, method, api):
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    spec = None if method is None else SpeculativeConfig(method, 3, model=str(target) if method == "draft_model" else None)
    kw = dict(dtype="bfloat16", device="cuda", max_num_seqs=8, num_kv_blocks=256, speculative_config=spec)
    if api == "LLM":
        llm = LLM(target, **kw)
        llm.generate([[5, 6, 7, 8], [9] * 20], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    else:
        llm = AsyncLLM(target, **kw)
        _use_async(llm)
    held = torch.cuda.memory_allocated() - before
    assert held > 0
    del llm
    gc.collect()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - before
    assert left <= 1 << 20, f"{left / 2**20:.1f} MiB of {held / 2**20:.1f} MiB still allocated after the engine was dropped"
