"""FP8 KV cache (``kv_cache_dtype="fp8"``; docs/design.md, "Caches").

- The ops: ``write_kv`` stores e4m3 codes of x / scale (clamped to +-448) and ``paged_attention_ref``
  reads code * scale; together they equal float32 attention written here over K / V passed
  through the same round trip with plain torch ops (GQA, ragged prefill / decode rows, padded
  tokens in the null block, non-unit scales, saturation).
- The engine: float32 model, scale 1.0 (no checkpoint scales) gives the greedy tokens and prefill
  logits of transformers whose k_proj / v_proj outputs are hooked through the FP8 round trip
  (Nemotron-H has no RoPE, so that is the FP8-cache model), under chunked prefill and decode; the
  logits measurably differ from the float32-KV engine's (fp8 is not silently ignored).
- Speculation (n-gram, MTP, draft model), prefix caching and n > 1 forks, all on FP8 caches, give
  the FP8 engine's plain greedy tokens; the drafters' own caches are FP8 too.
- Sizing: the same byte budget holds twice the blocks of a bfloat16 cache.
- Bad input: any other kv_cache_dtype is a ValueError naming the field and the allowed values,
  raised before the model is looked up; a GPU without float8 is refused.
Checkpoint scales: tests/quant/test_kv_scales.py. The Triton kernel: tests/gpu/ (interpreter
cases run on CPU).
"""
import math
import os

import numpy as np
import pytest
import torch

from hf_reference import NoHostSync, engine_prefill_hidden, fp8_kv_hooks, fp8_round_trip, hf_greedy, hf_logits
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.attention import KVCache, paged_attention_ref, write_kv
from hybrid_engine.config import SpeculativeConfig

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")   # "cuda" runs the same tests on a GPU
FP8 = torch.float8_e4m3fn
NEW = 8


# ---------------------------------------------------------------------------------------- ops

def _dense_attention(q, K, V, start, scale):
    """float32 causal attention of queries q [L, nH, hd] at positions start.. over K, V [S, nkv, hd]."""
    g = q.shape[1] // K.shape[1]
    Kh, Vh = K.repeat_interleave(g, 1), V.repeat_interleave(g, 1)              # [S, nH, hd]
    out = torch.empty(q.shape)
    for i in range(q.shape[0]):
        n = start + i + 1                                                      # keys 0..pos
        s = torch.einsum("hd,shd->hs", q[i], Kh[:n]) * scale
        out[i] = torch.einsum("hs,shd->hd", torch.softmax(s, -1), Vh[:n])
    return out


def test_write_and_read_equal_float32_attention_over_round_tripped_kv():
    g = torch.Generator().manual_seed(0)
    nH, nkv, hd, bs, NB = 8, 2, 16, 4, 24
    ks, vs = torch.tensor(0.0173), torch.tensor(0.61)
    rows = [(0, 7), (5, 1), (9, 3), (0, 1), (13, 4)]     # (context, query tokens): prefill, decode, chunks
    kc = torch.zeros(NB, bs, nkv, hd, dtype=FP8)
    vc = torch.zeros_like(kc)
    perm = (torch.randperm(NB - 1, generator=g) + 1).tolist()
    M = max(-(-(c + n) // bs) for c, n in rows) + 1
    bt = torch.zeros(len(rows), M, dtype=torch.int32)                          # unused columns: null block
    K, V, slots = [], [], []
    for b, (c, n) in enumerate(rows):
        nblk = -(-(c + n) // bs)
        bt[b, :nblk] = torch.tensor([perm.pop() for _ in range(nblk)], dtype=torch.int32)
        K.append(torch.randn(c + n, nkv, hd, generator=g) * 2.0)
        V.append(torch.randn(c + n, nkv, hd, generator=g) * 40.0)
        pos = torch.arange(c + n)
        slots.append(bt[b, pos // bs].long() * bs + pos % bs)
    K[0][2, 1, :3] = torch.tensor([20.0, -9.0, 7.76])                        # beyond 448 * ks: saturate
    V[2][4, 0, 5] = -300.0
    # earlier steps wrote the context; this step writes the query tokens, then 3 padded tokens
    ctx = [(k[:c], v[:c], s[:c]) for k, v, s, (c, _) in zip(K, V, slots, rows)]
    write_kv(torch.cat([x[0] for x in ctx]), torch.cat([x[1] for x in ctx]), kc, vc, torch.cat([x[2] for x in ctx]),
             ks, vs)
    pad_k = torch.full((3, nkv, hd), 1e9)
    pad_k[0, 0, 0] = math.nan
    cur_k = torch.cat([k[c:] for k, (c, _) in zip(K, rows)] + [pad_k])
    cur_v = torch.cat([v[c:] for v, (c, _) in zip(V, rows)] + [pad_k])
    cur_s = torch.cat([s[c:] for s, (c, _) in zip(slots, rows)] + [torch.zeros(3, dtype=torch.long)])
    q_lens = [n for _, n in rows]
    T = sum(q_lens)
    q = torch.randn(T + 3, nH, hd, generator=g)
    qsl = torch.tensor([0] + np.cumsum(q_lens).tolist(), dtype=torch.int32)
    sl = torch.tensor([c + n for c, n in rows], dtype=torch.int32)
    max_seq = max(c + n for c, n in rows)
    with NoHostSync():                                                         # the step path's rule
        write_kv(cur_k, cur_v, kc, vc, cur_s, ks, vs)
        out = paged_attention_ref(q, kc, vc, qsl, sl, bt, hd ** -0.5, max(q_lens), max_seq,
                                  k_scale=ks, v_scale=vs)
    # the stored codes, bit for bit
    flat = kc.view(-1, nkv, hd).view(torch.uint8)
    for k, s in zip(K, slots):
        want = (k / ks).clamp(-448, 448).to(FP8).view(torch.uint8)
        assert torch.equal(flat[s], want)
    # the attention
    want = torch.zeros(T + 3, nH, hd)
    for b, (c, n) in enumerate(rows):
        t0 = int(qsl[b])
        want[t0:t0 + n] = _dense_attention(q[t0:t0 + n], fp8_round_trip(K[b], float(ks)),
                                           fp8_round_trip(V[b], float(vs)), c, hd ** -0.5)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(out[T:], torch.zeros(3, nH, hd))                       # padded tokens: zeros
    # reading the codes as if they were values (scales ignored) is far off: the scales matter
    plain = paged_attention_ref(q, kc.float(), vc.float(), qsl, sl, bt, hd ** -0.5, max(q_lens), max_seq)
    assert (plain - want).abs().max() > 1.0


def test_kv_cache_holds_codes_and_scales():
    kv = KVCache(3, 5, 4, 2, 8, FP8)
    assert kv.quantized and kv.k[0].dtype == FP8 and kv.bytes == 2 * 3 * 5 * 4 * 2 * 8
    assert [float(s) for s in kv.k_scale + kv.v_scale] == [1.0] * 6
    held = kv.k_scale[1]
    kv.set_scales([0.5, 0.25, 2.0], torch.tensor([1.0, 3.0, 0.125]))
    assert kv.k_scale[1] is held and float(held) == 0.25                      # in place: graphs keep reading it
    assert [float(s) for s in kv.scales(2)] == [2.0, 0.125]
    with pytest.raises(ValueError, match=r"k_scales must be positive and finite"):
        kv.set_scales([1.0, 0.0, 1.0], [1.0] * 3)
    with pytest.raises(ValueError, match=r"v_scales needs 3 values"):
        kv.set_scales([1.0] * 3, [1.0] * 2)
    plain = KVCache(1, 2, 4, 1, 8, torch.bfloat16)
    assert plain.scales(0) == (None, None) and not plain.quantized


def test_scales_must_match_the_cache_dtype():
    """An FP8 cache read or written without its scales (which would silently mean 1.0), or a 16-bit
    cache given scales, is a ValueError before anything runs."""
    from hybrid_engine.attention import paged_attention
    fp8, plain = KVCache(1, 3, 4, 1, 8, FP8), KVCache(1, 3, 4, 1, 8, torch.float32)
    q, kv_new = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    qsl, sl, bt, slots = torch.tensor([0, 2]), torch.tensor([2]), torch.tensor([[1]]), torch.tensor([4, 5])
    s = torch.tensor(0.5)
    with pytest.raises(ValueError, match="needs both k_scale / v_scale"):
        paged_attention(q, fp8.k[0], fp8.v[0], qsl, sl, bt, 0.3, 2, 2)
    with pytest.raises(ValueError, match="needs both k_scale / v_scale"):
        write_kv(kv_new, kv_new, fp8.k[0], fp8.v[0], slots, k_scale=s)
    with pytest.raises(ValueError, match="needs no k_scale / v_scale"):
        write_kv(kv_new, kv_new, plain.k[0], plain.v[0], slots, k_scale=s, v_scale=s)
    write_kv(kv_new, kv_new, fp8.k[0], fp8.v[0], slots, k_scale=s, v_scale=s)      # both: accepted
    out = paged_attention(q, fp8.k[0], fp8.v[0], qsl, sl, bt, 0.3, 2, 2, k_scale=s, v_scale=s)
    assert out.shape == q.shape and torch.isfinite(out).all()


# ------------------------------------------------------------------------------------- engine

N_ATTN = 2                                            # attention layers of hybrid_dir ("M-M*-ME*")
ONES = [1.0] * N_ATTN


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, 256, n).tolist() for n in (40, 3, 23, 17, 1)]


def _fp8(d, **kw):
    args = dict(dtype="float32", device=DEV, kv_cache_dtype="fp8", max_num_seqs=4, num_kv_blocks=96, block_size=4)
    return LLM(d, **{**args, **kw})


def _greedy(llm, prompts, n=NEW):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def fp8_greedy(hybrid_dir, prompts):
    """The FP8 engine's greedy tokens: chunked prefill (16-token budget < 40- and 23-token prompts),
    4-token blocks, async scheduling."""
    return _greedy(_fp8(hybrid_dir, max_num_batched_tokens=16), prompts)


def test_greedy_equals_transformers_with_fp8_kv(hybrid_dir, prompts, fp8_greedy):
    with fp8_kv_hooks(hybrid_dir, ONES, ONES):
        want = hf_greedy(hybrid_dir, prompts, NEW)
    assert fp8_greedy == want


def test_fp8_kv_is_really_used(hybrid_dir, caplog):
    ids = np.random.default_rng(1).integers(3, 256, 41).tolist()
    with caplog.at_level("INFO", logger="hybrid_engine"):
        llm8 = _fp8(hybrid_dir)
    assert "KV cache in torch.float8_e4m3fn with scale 1.0" in caplog.text and "saturate" in caplog.text
    assert "in torch.float8_e4m3fn (" in caplog.text                          # the engine-ready line
    llm32 = LLM(hybrid_dir, dtype="float32", device=DEV, max_num_seqs=4, num_kv_blocks=96, block_size=4)
    kv8, kv32 = llm8.engine.caches.kv, llm32.engine.caches.kv
    assert kv8.k[0].dtype == FP8 and kv32.k[0].dtype == torch.float32 and kv32.k_scale is None
    with torch.inference_mode():
        ours = llm8.engine.model.compute_logits(engine_prefill_hidden(llm8, ids)).cpu()
        full = llm32.engine.model.compute_logits(engine_prefill_hidden(llm32, ids)).cpu()
    with fp8_kv_hooks(hybrid_dir, ONES, ONES):
        ref = hf_logits(hybrid_dir, ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(full, hf_logits(hybrid_dir, ids), atol=1e-4, rtol=1e-4)
    gap = float((ours - full).abs().max())
    assert gap > 1e-2, gap                             # 100x the tolerance: FP8 K/V change the logits


@pytest.mark.parametrize("method", ["ngram", "mtp", "draft_model"])
def test_speculation_on_fp8_kv_equals_greedy(hybrid_dir, prompts, fp8_greedy, method):
    spec = SpeculativeConfig(method, 3, model=str(hybrid_dir) if method == "draft_model" else None)
    llm = _fp8(hybrid_dir, max_num_batched_tokens=16, speculative_config=spec)
    if method != "ngram":                              # the drafter's own KV follows kv_cache_dtype
        assert llm.engine.drafter.kv.k[0].dtype == FP8 and llm.engine.drafter.kv.k_scale is not None
    assert _greedy(llm, prompts) == fp8_greedy
    assert llm.engine.stats(expert_load=False)["drafts_proposed"] > 0


def test_prefix_caching_and_forks_on_fp8_kv(hybrid_dir, prompts, fp8_greedy):
    """A prompt that shares a cached prefix (blocks shared, not copied) and n=2 (the sibling's
    blocks are copied from the leader's): FP8 blocks move as bytes, tokens are unchanged."""
    llm = _fp8(hybrid_dir, max_num_batched_tokens=16, enable_prefix_caching=True, mamba_checkpoint_interval=2)
    assert _greedy(llm, prompts[:1]) == fp8_greedy[:1]
    assert _greedy(llm, prompts[:1]) == fp8_greedy[:1]
    assert llm.engine.stats(expert_load=False)["prefix_cache_hit_tokens"] > 0
    outs = llm.generate(prompts[2:3], SamplingParams(n=2, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert [list(c.token_ids) for c in outs[0].outputs] == [fp8_greedy[2]] * 2


def test_same_budget_holds_twice_the_blocks_of_bf16(hybrid_dir):
    budget = 1 << 20
    kw = dict(dtype="bfloat16", device="cpu", max_num_seqs=2, kv_cache_bytes=budget)
    bf16 = LLM(hybrid_dir, **kw).engine
    fp8 = LLM(hybrid_dir, kv_cache_dtype="fp8", **kw).engine
    n16, n8 = bf16.scheduler.blocks.num_total, fp8.scheduler.blocks.num_total
    assert 2 * n16 <= n8 <= 2 * n16 + 1, (n16, n8)
    assert fp8.caches.kv.k[0].dtype == FP8 and budget * 0.99 < fp8.caches.kv.bytes <= budget
    # with MTP, target + MTP KV (both FP8) share the budget
    mtp = LLM(hybrid_dir, kv_cache_dtype="fp8", speculative_config=SpeculativeConfig("mtp", 2), **kw).engine
    assert mtp.drafter.kv.k[0].dtype == FP8
    assert budget * 0.95 < mtp.caches.kv.bytes + mtp.drafter.kv.bytes <= budget


# ------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("bad", ["int8", "FP8", "float16", None, 8])
def test_bad_kv_cache_dtype_is_named_before_the_model_is_read(tmp_path, bad):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', got "):
        LLM(tmp_path / "no_such_model", kv_cache_dtype=bad)


def test_alias_and_gpu_without_float8(hybrid_dir, monkeypatch):
    from hybrid_engine.config import CacheConfig, EngineConfig, ModelConfig
    assert CacheConfig(kv_cache_dtype="fp8_e4m3").kv_dtype(torch.bfloat16) == FP8
    assert CacheConfig().kv_dtype(torch.bfloat16) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "A100")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' needs a GPU with float8 support .* A100 has 8.0"):
        EngineConfig(model_dir=hybrid_dir, model=ModelConfig.from_json(hybrid_dir),
                     cache=CacheConfig(kv_cache_dtype="fp8"), device=torch.device("cuda", 0))
