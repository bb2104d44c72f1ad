"""FP8 KV-cache scales from a checkpoint (hybrid_engine/quantization/kv_scales.py).

``python -m hybrid_engine.quantize --kv-cache-fp8`` writes ModelOpt's layout: per attention layer a
float32 [] ``k_proj.k_scale`` / ``v_proj.v_scale`` and ``kv_cache_quant_algo: "FP8"``. Loaded with
``kv_cache_dtype="fp8"``, the engine's per-layer scales are the file's, bit for bit, and its outputs
equal transformers on the dequantized weights with k_proj / v_proj outputs passed through the FP8
round trip with those scales (non-unit, per layer). The other spelling (``<attn>.k_scale``) reads
the same; missing or doubled scales are refused by name; with ``kv_cache_dtype="auto"`` the cache
stays in the model dtype and the scales are reported unused (vLLM's reading of "auto").
"""
import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_reference import engine_prefill_hidden, fp8_kv_hooks, hf_greedy, hf_logits
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.config import SpeculativeConfig
from hybrid_engine.quantize import quantize_folder

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")   # "cuda" runs the same tests on a GPU
ATTN = ("backbone.layers.1.mixer", "backbone.layers.4.mixer")   # attention layers of "M*M-*E"


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _write(folder, tensors, config):
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybrid_engine.models.synthetic import make_hf_model
    root = tmp_path_factory.mktemp("kvq")
    src = make_hf_model(root / "src", "M*M-*E", seed=6, num_nextn_predict_layers=1, mtp_pattern="*E")
    qdir = root / "fp8kv"
    quantize_folder(src, qdir, "fp8", calibrate_prompts=1, kv_cache=True)
    # transformers' twin: the quantized folder's weights dequantized here (float32), no scales
    t = _tensors(qdir)
    twin = {k: (v.float() * t[k[: -len("weight")] + "weight_scale"].float() if v.dtype == torch.float8_e4m3fn
                else v.float()).contiguous()
            for k, v in t.items() if not k.endswith(("_scale", "_scale_2", ".k_scale", ".v_scale"))}
    _write(root / "twin", twin, json.loads((src / "config.json").read_text()))
    return {"src": src, "fp8kv": qdir, "twin": root / "twin"}


def _file_scales(folder):
    t = _tensors(folder)
    return ([t[f"{a}.k_proj.k_scale"] for a in ATTN], [t[f"{a}.v_proj.v_scale"] for a in ATTN])


def test_quantizer_writes_the_published_kv_scales(folders):
    t = _tensors(folders["fp8kv"])
    names = sorted(k for k in t if k.endswith(("k_scale", "v_scale")))
    assert names == sorted([f"{a}.k_proj.k_scale" for a in ATTN] + [f"{a}.v_proj.v_scale" for a in ATTN])
    for n in names:
        assert t[n].dtype == torch.float32 and t[n].shape == () and 0 < float(t[n]) < 1
    cfg = json.loads((folders["fp8kv"] / "config.json").read_text())["quantization_config"]
    assert cfg["kv_cache_quant_algo"] == "FP8"
    hq = json.loads((folders["fp8kv"] / "hf_quant_config.json").read_text())["quantization"]
    assert hq["kv_cache_quant_algo"] == "FP8"


def test_engine_uses_the_file_scales_and_equals_the_hooked_reference(folders):
    ks, vs = _file_scales(folders["fp8kv"])
    assert len({float(s) for s in ks + vs}) == 4                       # per layer, per K / V, non-unit
    llm = LLM(folders["fp8kv"], dtype="float32", device=DEV, kv_cache_dtype="fp8", max_num_seqs=4,
              max_num_batched_tokens=16, block_size=4, num_kv_blocks=96,
              speculative_config=SpeculativeConfig("mtp", 2))
    kv = llm.engine.caches.kv
    for i in range(len(ATTN)):
        assert torch.equal(kv.k_scale[i].cpu(), ks[i]) and torch.equal(kv.v_scale[i].cpu(), vs[i])
    mtp = llm.engine.drafter.kv                                         # no mtp.* scales stored: 1.0
    assert mtp.k[0].dtype == torch.float8_e4m3fn and float(mtp.k_scale[0]) == float(mtp.v_scale[0]) == 1.0
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, n).tolist() for n in (37, 4, 21)]
    ids = prompts[0]
    with fp8_kv_hooks(folders["twin"], ks, vs):
        want = hf_greedy(folders["twin"], prompts, 8)
        ref = hf_logits(folders["twin"], ids)
    got = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    with torch.inference_mode():
        ours = llm.engine.model.compute_logits(engine_prefill_hidden(llm, ids)).cpu()
    # on CPU the engine's K / V equal transformers' to the last bits; on CUDA they differ by ~1e-7
    # relative, and the few values that sit on an FP8 rounding boundary land one code apart (3
    # mantissa bits: a 6-12% step), which moves these logits by up to ~2e-3 (H200, 2026-11-26).
    # Greedy tokens stay equal on both.
    tol = dict(atol=1e-4, rtol=1e-4) if str(DEV) == "cpu" else dict(atol=5e-3, rtol=0.0)
    torch.testing.assert_close(ours, ref, **tol)
    assert float((ours - hf_logits(folders["twin"], ids)).abs().max()) > 1e-2   # the round trip matters


def test_the_short_spelling_reads_the_same(folders, tmp_path):
    t = _tensors(folders["fp8kv"])
    for a in ATTN:
        t[f"{a}.k_scale"], t[f"{a}.v_scale"] = t.pop(f"{a}.k_proj.k_scale"), t.pop(f"{a}.v_proj.v_scale")
    d = _write(tmp_path / "short", t, json.loads((folders["fp8kv"] / "config.json").read_text()))
    llm = LLM(d, dtype="float32", device=DEV, kv_cache_dtype="fp8_e4m3", max_num_seqs=2, num_kv_blocks=16)
    ks, vs = _file_scales(folders["fp8kv"])
    assert [float(s) for s in llm.engine.caches.kv.k_scale] == [float(s) for s in ks]
    assert [float(s) for s in llm.engine.caches.kv.v_scale] == [float(s) for s in vs]


@pytest.mark.parametrize("edit,match", [
    ("drop", r"stores FP8 KV-cache scales for some attention layers but lacks backbone.layers.4.mixer.v_proj.v_scale"),
    ("twice", r"stores the K scale of backbone.layers.1.mixer twice"),
    ("negative", r"a KV-cache scale must be one positive finite float, got backbone.layers.1.mixer.k_proj.k_scale"),
])
def test_bad_scales_are_named(folders, tmp_path, edit, match):
    t = _tensors(folders["fp8kv"])
    if edit == "drop":
        del t[f"{ATTN[1]}.v_proj.v_scale"]
    elif edit == "twice":
        t[f"{ATTN[0]}.k_scale"] = t[f"{ATTN[0]}.k_proj.k_scale"].clone()
    else:
        t[f"{ATTN[0]}.k_proj.k_scale"] = torch.tensor(-0.5)
    d = _write(tmp_path / edit, t, json.loads((folders["fp8kv"] / "config.json").read_text()))
    with pytest.raises(ValueError, match=match):
        LLM(d, dtype="float32", device=DEV, kv_cache_dtype="fp8", max_num_seqs=2, num_kv_blocks=16)


def test_auto_keeps_the_model_dtype_and_says_the_scales_are_unused(folders, caplog):
    with caplog.at_level("INFO", logger="hybrid_engine"):
        llm = LLM(folders["fp8kv"], dtype="float32", device=DEV, max_num_seqs=2, num_kv_blocks=16)
    kv = llm.engine.caches.kv
    assert kv.k[0].dtype == torch.float32 and kv.k_scale is None
    assert "kv_cache_dtype='auto' keeps K and V in torch.float32 and its k_scale / v_scale are unused" in caplog.text


def test_non_fp8_kv_algo_is_refused_with_fp8(folders, tmp_path):
    cfg = json.loads((folders["fp8kv"] / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_quant_algo"] = "NVFP4"
    d = tmp_path / "nv"
    d.mkdir()
    (d / "model.safetensors").symlink_to(folders["fp8kv"] / "model.safetensors")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' but the checkpoint's kv_cache_quant_algo is 'NVFP4'"):
        LLM(d, dtype="float32", device=DEV, kv_cache_dtype="fp8")
