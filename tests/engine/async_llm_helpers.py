"""Shared by the AsyncLLM tests (test_async_llm.py, test_async_failures.py): the engine factory,
the stream collector and the module-scoped prompts / transformers reference fixtures."""
import asyncio
import os

import numpy as np
import pytest

from hybrid_engine import AsyncLLM, SamplingParams
from hf_reference import hf_greedy

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, n).tolist() for n in (3, 17, 40, 1, 9)]


@pytest.fixture(scope="module")
def reference(hybrid_dir, prompts):
    return hf_greedy(hybrid_dir, prompts, max_new_tokens=MAX_TOKENS)


def make(hybrid_dir, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("device", DEV)
    return AsyncLLM(hybrid_dir, **kw)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


async def collect(engine, prompt, params=GREEDY, request_id=None, outs=None):
    """All deltas of one stream; returns (tokens, last output)."""
    toks, last = [], None
    async for out in engine.generate(prompt, params, request_id=request_id):
        assert last is None or not last.finished, "nothing may follow the finished output"
        if outs is not None:
            outs.append(out)
        toks += out.outputs[0].token_ids
        last = out
    return toks, last


async def wait_until(cond, timeout=30.0):
    t0 = asyncio.get_running_loop().time()
    while not cond():
        assert asyncio.get_running_loop().time() - t0 < timeout, "timed out"
        await asyncio.sleep(0.001)
