"""FP8 KV cache on CUDA (``kv_cache_dtype="fp8"``): the Triton attention kernel reading float8_e4m3fn
K / V tiles against the exactly dequantizing torch reference (random codes over the whole e4m3
range, non-unit scales, bf16 / fp16 / fp32 q, split and non-split paths, ragged rows, poisoned
null block and unwritten tails), ``write_kv``'s codes on the GPU against the CPU's, and the engine:
float32 greedy equal to transformers hooked through the FP8 round trip, CUDA graphs equal to
eager (plain, MTP and draft-model speculation), and no host sync on the async step path.
The same engine tests run on CPU in tests/engine/test_fp8_kv_cache.py and tests/quant/test_kv_scales.py
(``HYBRID_ENGINE_TEST_DEVICE=cuda`` runs those on the GPU too)."""
import functools
import sys
from pathlib import Path

import pytest
import torch

import attention_cases as ac
from engine_steps import launch_steps_without_sync
from hf_reference import fp8_kv_hooks, hf_greedy
from hybrid_engine import LLM, SamplingParams, SpeculativeConfig
from hybrid_engine.attention import ops as attn_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from kv_write_cases import CASES as KV_WRITE_CASES  # noqa: E402
from kv_write_cases import check as kv_write_check  # noqa: E402

pytestmark = pytest.mark.gpu

DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DT_IDS = ["f32", "bf16", "f16"]
SCALES = [(0.0123, 0.37), (1.0, 1.0), (2.5, 0.004)]     # per seed: (k_scale, v_scale)


@pytest.fixture(autouse=True)
def _triton_backend(monkeypatch):
    monkeypatch.delenv("HYBRID_ENGINE_KERNELS", raising=False)


# ----------------------------------------------------------------------------- the kernel

@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", range(len(ac.ATTN_CASES)))
def test_attention_fp8_kv(dtype, case):
    """Through the dispatcher (Triton for CUDA tensors), the default split choice."""
    for seed, scales in enumerate(SCALES):
        ac.check_attention(attn_ops.paged_attention, DEV, dtype, seed=seed, kv_scales=scales, **ac.ATTN_CASES[case])


@pytest.mark.parametrize("num_splits", [1, 3, 64])
@pytest.mark.parametrize("case", [0, 1, 2, 6])
def test_attention_fp8_kv_splits(num_splits, case):
    """Decode / verify rows with the key-range split forced off, small and large: the V scale
    multiplies each split's partial accumulator before the combine."""
    from hybrid_engine.attention.triton_attention import triton_paged_attention
    impl = functools.partial(triton_paged_attention, num_splits=num_splits)
    for dtype in (torch.float32, torch.bfloat16):
        ac.check_attention(impl, DEV, dtype, seed=num_splits, kv_scales=SCALES[0], **ac.ATTN_CASES[case])


@pytest.mark.parametrize("name", sorted(KV_WRITE_CASES) + ["f32_into_bf16", "bf16_into_fp8_many_tokens"])
def test_write_kv_triton_equals_the_torch_form(name):
    """``write_kv`` on CUDA (one Triton launch) into poisoned caches against its torch form on the
    CPU (tests/engine/kv_write_cases.py): casts, FP8 codes with saturating / tiny / NaN values,
    strided head rows, padding tokens; here also the float32 -> bfloat16 cast (the hardware rounds
    to nearest even; the interpreter does not) and a prefill-sized write."""
    case = KV_WRITE_CASES.get(name) or dict(
        f32_into_bf16=dict(T=7, nkv=3, hd=24, dtype=torch.float32, cache_dtype=torch.bfloat16, strided=True),
        bf16_into_fp8_many_tokens=dict(T=600, nkv=8, hd=128, dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                                       pad=5))[name]
    kv_write_check(attn_ops.write_kv, device=DEV, **case)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_write_kv_codes_equal_the_cpu_codes(dtype):
    """The quantizing write on the GPU stores the codes the CPU computes (x / scale rounded once;
    clamped at +-448), at the slots given; padded tokens only touch the null block."""
    g = torch.Generator().manual_seed(0)
    N, bs, nkv, hd, T = 12, 4, 2, 64, 20
    k = (torch.randn(T, nkv, hd, generator=g) * 3).to(dtype)
    v = (torch.randn(T, nkv, hd, generator=g) * 3).to(dtype)
    k[0, 0, :4] = torch.tensor([40.0, -40.0, 1e4, -1e4]).to(dtype)            # saturate
    slots = torch.randperm((N - 1) * bs, generator=g)[:T] + bs                 # outside the null block
    slots[-3:] = 0                                                             # padded tokens
    ks, vs = torch.tensor(0.0173), torch.tensor(0.61)
    kc_ = torch.zeros(N, bs, nkv, hd, dtype=torch.float8_e4m3fn, device=DEV)
    vc_ = torch.zeros_like(kc_)
    attn_ops.write_kv(k.to(DEV), v.to(DEV), kc_, vc_, slots.to(DEV), ks.to(DEV), vs.to(DEV))
    for cache, x, s in ((kc_, k, ks), (vc_, v, vs)):
        flat = cache.cpu().view(-1, nkv, hd).view(torch.uint8)
        want = (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(flat[slots[:-3]], want[:-3])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool)
        untouched[slots] = False
        assert not flat[untouched].any()


# ----------------------------------------------------------------------------- the engine

def _tokens(llm, prompts, n=16):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_fp8_kv_greedy_equals_hooked_transformers(target, prompts):
    """float32 model, CUDA graphs, async, chunked prefill: transformers with k_proj / v_proj
    outputs through the FP8 round trip (scale 1.0: the checkpoint has none)."""
    with fp8_kv_hooks(target, [1.0, 1.0], [1.0, 1.0]):
        want = hf_greedy(target, prompts, 16)
    llm = LLM(target, dtype="float32", device=DEV, kv_cache_dtype="fp8", max_num_seqs=8, max_num_batched_tokens=32)
    assert llm.engine.caches.kv.k[0].dtype == torch.float8_e4m3fn
    assert _tokens(llm, prompts) == want


@pytest.mark.parametrize("spec", [None, "mtp", "draft_model"])
def test_fp8_kv_graphs_equal_eager(target, prompts, spec):
    cfg = None if spec is None else SpeculativeConfig(spec, 3, model=str(target) if spec == "draft_model" else None)
    outs = {}
    for eager in (True, False):
        llm = LLM(target, dtype="bfloat16", device=DEV, kv_cache_dtype="fp8", max_num_seqs=8,
                  speculative_config=cfg, enforce_eager=eager, async_scheduling=True)
        outs[eager] = _tokens(llm, prompts, 24)
    assert outs[True] == outs[False]


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_fp8_kv_async_steps_never_sync_the_host(target, prompts, method):
    spec = SpeculativeConfig(method, 3, model=str(target) if method == "draft_model" else None)
    llm = LLM(target, dtype="bfloat16", device=DEV, kv_cache_dtype="fp8", max_num_seqs=8, speculative_config=spec)
    eng = llm.engine
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    for p in prompts:
        eng.add_request(eng.make_request(p, params))
    for _ in range(6):                       # warm-up: prefill, allocator and Triton caches
        eng.step()
    launch_steps_without_sync(eng, 30)
    for r in list(eng.scheduler.running):
        eng.abort(r.request_id)
