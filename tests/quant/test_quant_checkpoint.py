"""Quantized checkpoints end to end on CPU (docs/design.md, quantization).

- ``python -m hybrid_engine.quantize`` writes ModelOpt's published layout: checked tensor by tensor
  against values computed here from the source weights, and the config blocks field by field.
- The engine loads it: every quantized tensor equals the file's, bit for bit.
- Reference: transformers (float32) on a folder whose weights are the *dequantized* ones, decoded
  here independently of the engine (e2m1 table, nibble order, scales): the engine's FP8 / NVFP4
  logits must equal it to float32 accuracy (the CPU path dequantizes exactly).
- Closeness to the unquantized model, measured: FP8 rounds each weight to 3 mantissa bits (about
  2.5% rms relative error per matrix, independent between matrices); the O(1)-scale test model has
  ~12 matrices on a token's path, so logits move by ~sqrt(12) * 2.5% ~ 9% rms of their spread. The
  bound below (0.2) is about twice that; greedy agreement is reported, not asserted to be perfect.
- Composition: the FP8 model under chunked prefill, async scheduling and the MTP drafter (whose
  layers are quantized as stored) generates exactly what the FP8 model generates alone.
"""
import json
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_reference import engine_prefill_hidden, hf_logits
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.quantization.experts import Fp8Experts, Nvfp4Experts
from hybrid_engine.quantization.linear import Fp8Linear, Nvfp4Linear
from hybrid_engine.quantize import quantize_folder

DEV = os.environ.get("HYBRID_ENGINE_TEST_DEVICE", "cpu")   # "cuda" runs the same tests on a GPU
PATTERN = "M-M*-ME"
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
QUANTIZED_SUFFIXES = ("in_proj.weight", "out_proj.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight",
                      "o_proj.weight", "up_proj.weight", "down_proj.weight", "eh_proj.weight")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from hybrid_engine.models.synthetic import make_hf_model
    root = tmp_path_factory.mktemp("quant")
    src = make_hf_model(root / "src", PATTERN, seed=5, num_nextn_predict_layers=1, mtp_pattern="*E")
    out = {"src": src}
    for method in ("fp8", "nvfp4"):
        # NVFP4 is weight-only here: its input_scale is not used, so only FP8 is calibrated
        quantize_folder(src, root / method, method, calibrate_prompts=1 if method == "fp8" else 0)
        out[method] = root / method
    return out


def _tensors(folder):
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _is_quantized_linear(name: str) -> bool:
    return name.endswith(QUANTIZED_SUFFIXES) and ".experts." not in name and not name.startswith("lm_head")


def _decode_nvfp4(packed, bs, gs):
    """Independent NVFP4 decoder: low nibble = even element, bit 3 = sign."""
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    lo, hi = table[(packed & 0xF).long()], table[(packed >> 4).long()]
    vals = torch.stack([lo, hi], -1).flatten(-2)
    return vals * bs.float().repeat_interleave(16, -1) * gs.float()


def _dequantized_twin(qdir, src, out):
    """A float32 folder: the source config, the quantized folder's weights dequantized here."""
    t = _tensors(qdir)
    sd = {}
    for k, v in t.items():
        if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        base = k[: -len(".weight")]
        if v.dtype == torch.float8_e4m3fn:
            v = v.float() * t[base + ".weight_scale"].float()
        elif v.dtype == torch.uint8:
            v = _decode_nvfp4(v, t[base + ".weight_scale"], t[base + ".weight_scale_2"])
        sd[k] = v.float().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def _logits(llm, ids):
    with torch.inference_mode():
        return llm.engine.model.compute_logits(engine_prefill_hidden(llm, ids)).cpu()


IDS = np.random.default_rng(0).integers(3, 256, 37).tolist()     # > 2 SSD chunks and KV blocks


# --------------------------------------------------------------------------------- the layout

def test_fp8_folder_is_the_published_layout(folders):
    src, q = _tensors(folders["src"]), _tensors(folders["fp8"])
    quantized = [k for k in src if _is_quantized_linear(k)]
    assert len(quantized) >= 14                        # Mamba, attention, MLP, shared expert, MTP
    for k, w in src.items():
        if k not in quantized:
            assert torch.equal(q[k], w), k             # everything else copied as stored
            continue
        base = k[: -len(".weight")]
        scale = q[base + ".weight_scale"]
        assert q[k].dtype == torch.float8_e4m3fn and q[k].shape == w.shape, k
        assert scale.dtype == torch.float32 and scale.shape == () and float(scale) == float(w.abs().max() / 448)
        assert torch.equal(q[k], (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)), k
    # every layer the calibration run reached (the backbone; MTP is not run) has a static input scale
    for k in quantized:
        base = k[: -len(".weight")]
        if k.startswith("backbone."):
            s = q[base + ".input_scale"]
            assert s.dtype == torch.float32 and s.shape == () and float(s) > 0
    cfg = json.loads((folders["fp8"] / "config.json").read_text())["quantization_config"]
    assert cfg == {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None,
                   "exclude_modules": ["lm_head", "backbone.layers.6.mixer.experts*",
                                       "mtp.layers.1.mixer.experts*"]}
    hq = json.loads((folders["fp8"] / "hf_quant_config.json").read_text())
    assert hq["producer"]["name"] == "modelopt"
    assert hq["quantization"] == {k: v for k, v in cfg.items() if k != "quant_method"}


def test_nvfp4_folder_is_the_published_layout(folders):
    src, q = _tensors(folders["src"]), _tensors(folders["nvfp4"])
    for k, w in src.items():
        if not _is_quantized_linear(k):
            continue
        base = k[: -len(".weight")]
        n, kk = w.shape
        assert q[k].dtype == torch.uint8 and q[k].shape == (n, kk // 2), k
        bs, gs = q[base + ".weight_scale"], q[base + ".weight_scale_2"]
        assert bs.dtype == torch.float8_e4m3fn and bs.shape == (n, kk // 16)
        assert gs.dtype == torch.float32 and gs.shape == () and float(gs) == float(w.abs().max() / (6 * 448))
        deq = _decode_nvfp4(q[k], bs, gs)
        # nearest point of each block's e2m1 grid: within one grid step (the largest is 2 units)
        step = bs.float().repeat_interleave(16, -1) * gs
        assert ((deq - w.float()).abs() <= step + 1e-6).all(), k
    cfg = json.loads((folders["nvfp4"] / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "modelopt" and cfg["quant_algo"] == "NVFP4" and cfg["group_size"] == 16


@pytest.mark.parametrize("method,cls", [("fp8", Fp8Linear), ("nvfp4", Nvfp4Linear)])
def test_loaded_tensors_equal_the_file(folders, method, cls):
    llm = LLM(folders[method], dtype="bfloat16", device=DEV, max_num_seqs=2)
    q = _tensors(folders[method])
    mods = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, cls)}
    assert len(mods) == sum(1 for k in q if k.startswith("backbone.") and _is_quantized_linear(k))
    for n, m in mods.items():
        for attr, t in m.named_parameters(recurse=False):
            assert t.dtype == q[f"{n}.{attr}"].dtype and torch.equal(t.cpu(), q[f"{n}.{attr}"]), f"{n}.{attr}"
    assert not isinstance(llm.engine.model.lm_head, cls)            # excluded: stays 16-bit
    assert llm.engine.model.lm_head.weight.dtype == torch.bfloat16


# ------------------------------------------------------------------------------- the numerics

@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_logits_equal_transformers_on_the_dequantized_weights(folders, tmp_path, method):
    twin = _dequantized_twin(folders[method], folders["src"], tmp_path / "twin")
    llm = LLM(folders[method], dtype="float32", device=DEV, max_num_seqs=2)
    ref = hf_logits(twin, IDS)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(_logits(llm, IDS), ref, atol=1e-4, rtol=1e-4)


def test_online_fp8_per_channel(folders, tmp_path):
    base = LLM(folders["src"], dtype="float32", device=DEV, max_num_seqs=2)
    llm = LLM(folders["src"], dtype="float32", device=DEV, max_num_seqs=2, quantization="fp8")
    assert llm.engine.cfg.quantization.source == "online"
    src = load_file(str(folders["src"] / "model.safetensors"))
    mods = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, Fp8Linear)}
    assert len(mods) == sum(1 for k in src if k.startswith("backbone.") and _is_quantized_linear(k))
    twin = {}
    for n, m in mods.items():
        w, w_q, scale = src[n + ".weight"], m.weight.cpu(), m.weight_scale.cpu()
        assert scale.shape == (w.shape[0],)                              # one scale per output channel
        # computed where the quantizer ran (CUDA divides by a scalar as a multiply by its reciprocal)
        assert torch.equal(scale, (w.to(DEV).abs().amax(1) / 448).cpu())
        twin[n + ".weight"] = w_q.float() * scale[:, None]
    assert not isinstance(llm.engine.model.lm_head, Fp8Linear)
    experts = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, Fp8Experts)}
    assert list(experts) == ["backbone.layers.6.mixer.experts"]       # per-expert scales
    for n, m in experts.items():
        for proj in ("up_proj", "down_proj"):
            w_q, scale = getattr(m, proj).cpu(), getattr(m, proj + "_weight_scale").cpu()
            for e in range(w_q.shape[0]):
                w = src[f"{n}.{e}.{proj}.weight"]
                assert float(scale[e]) == float(w.to(DEV).abs().max() / 448)
                twin[f"{n}.{e}.{proj}.weight"] = w_q[e].float() * scale[e]
    sd = {k: twin.get(k, v) for k, v in src.items()}
    (tmp_path / "twin").mkdir()
    save_file(sd, str(tmp_path / "twin" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "twin" / "config.json").write_text((folders["src"] / "config.json").read_text())
    ours = _logits(llm, IDS)
    torch.testing.assert_close(ours, hf_logits(tmp_path / "twin", IDS), atol=1e-4, rtol=1e-4)
    # closeness to the unquantized model (bound: module docstring)
    full = _logits(base, IDS)
    rel = float((ours - full).norm() / (full - full.mean(-1, keepdim=True)).norm())
    assert rel < 0.2, rel
    agree = float((ours.argmax(-1) == full.argmax(-1)).float().mean())
    print(f"FP8 online: logits rel err {rel:.3f}, argmax agreement {agree:.2f} over {len(IDS)} positions")
    assert agree >= 0.5


# ------------------------------------------------------------------------------- composition

def test_fp8_composes_with_mtp_async_and_chunked_prefill(folders):
    prompts = [np.random.default_rng(i).integers(3, 256, n).tolist() for i, n in enumerate((30, 5, 41))]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    alone = LLM(folders["fp8"], dtype="float32", device=DEV, max_num_seqs=4, async_scheduling=False)
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, sp, use_tqdm=False)]
    llm = LLM(folders["fp8"], dtype="float32", device=DEV, max_num_seqs=2, max_num_batched_tokens=16,
              async_scheduling=True, speculative_config=_mtp(2))
    mtp_q = [n for n, m in llm.engine.model.named_modules() if n.startswith("mtp.") and isinstance(m, Fp8Linear)]
    assert len(mtp_q) == 7                              # eh_proj, q/k/v/o, shared expert up/down
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want


def _mtp(k):
    from hybrid_engine.config import SpeculativeConfig
    return SpeculativeConfig(method="mtp", num_speculative_tokens=k)


# ------------------------------------------------------------------------------------ errors

def _with_config(src, tmp_path, **edits):
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(edits)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 4}, r"quant_method 'gptq', quant_algo None\) is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "W4A16_AWQ"}, r"quant_algo 'W4A16_AWQ'\) is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, r"group_size must be 16"),
])
def test_unsupported_checkpoint_quantization_is_named(folders, tmp_path, qc, match):
    d = _with_config(folders["src"], tmp_path, quantization_config=qc)
    with pytest.raises(ValueError, match=match):
        LLM(d, dtype="float32", device=DEV)


@pytest.mark.parametrize("arg,where,match", [
    ("int4", "src", r"quantization must be None, 'fp8'"),
    ("modelopt", "src", r"has no quantization_config"),
    ("nvfp4", "fp8", r"quantization='nvfp4' but the checkpoint is stored in 'fp8'"),
])
def test_bad_quantization_argument(folders, arg, where, match):
    with pytest.raises(ValueError, match=match):
        LLM(folders[where], dtype="float32", device=DEV, quantization=arg)


@pytest.mark.parametrize("method", ["fp8", "nvfp4"])
def test_quantized_experts_load(folders, tmp_path, method, caplog):
    """Routed experts stored quantized per expert (the published MoE releases) run as FP8 / NVFP4
    experts in the fused MoE: stacked from the per-expert tensors bit for bit (NVFP4: packed
    codes, block scales and per-tensor scales), the input scales read past; the logits equal
    transformers on the dequantized weights."""
    qdir = tmp_path / "qe"
    quantize_folder(folders["src"], qdir, method, calibrate_prompts=0, experts=True)
    t = _tensors(qdir)
    up = "backbone.layers.6.mixer.experts.1.up_proj"
    assert t[up + ".weight"].dtype == (torch.float8_e4m3fn if method == "fp8" else torch.uint8)
    assert up + ".weight_scale" in t
    with caplog.at_level("WARNING", logger="hybrid_engine"):
        llm = LLM(qdir, dtype="float32", device=DEV, max_num_seqs=2)
    assert "dequantized" not in caplog.text
    cls = Fp8Experts if method == "fp8" else Nvfp4Experts
    suffixes = ("weight", "weight_scale") + (("weight_scale_2",) if method == "nvfp4" else ())
    swapped = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, cls)}
    assert "backbone.layers.6.mixer.experts" in swapped
    for name, experts in swapped.items():
        for e in range(experts.num_experts):
            for proj in ("up_proj", "down_proj"):
                for suffix in suffixes:
                    stacked = getattr(experts, proj if suffix == "weight" else f"{proj}_{suffix}")[e].cpu()
                    stored = t[f"{name}.{e}.{proj}.{suffix}"]
                    assert stacked.dtype == stored.dtype and torch.equal(stacked, stored), f"{name}.{e}.{proj}.{suffix}"
    twin = _dequantized_twin(qdir, folders["src"], tmp_path / "twin")
    torch.testing.assert_close(_logits(llm, IDS), hf_logits(twin, IDS), atol=1e-4, rtol=1e-4)


def test_online_nvfp4_quantizes_the_experts(folders, tmp_path):
    """``LLM(quantization="nvfp4")`` on a 16-bit MoE checkpoint: each expert's projections become
    NVFP4 (decoded here independently: within one e2m1 grid step of the source weight), and the
    logits equal transformers on those decoded weights."""
    llm = LLM(folders["src"], dtype="float32", device=DEV, max_num_seqs=2, quantization="nvfp4")
    src = load_file(str(folders["src"] / "model.safetensors"))
    experts = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, Nvfp4Experts)}
    assert "backbone.layers.6.mixer.experts" in experts
    twin = {n + ".weight": _decode_nvfp4(m.weight.cpu(), m.weight_scale.cpu(), m.weight_scale_2.cpu())
            for n, m in llm.engine.model.named_modules() if isinstance(m, Nvfp4Linear)}
    for n, m in experts.items():
        for proj in ("up_proj", "down_proj"):
            packed, bs, gs = (getattr(m, proj + s).cpu() for s in ("", "_weight_scale", "_weight_scale_2"))
            for e in range(packed.shape[0]):
                w, deq = src[f"{n}.{e}.{proj}.weight"], _decode_nvfp4(packed[e], bs[e], gs[e])
                step = bs[e].float().repeat_interleave(16, -1) * gs[e]
                assert ((deq - w.float()).abs() <= step + 1e-6).all(), f"{n}.{e}.{proj}"
                twin[f"{n}.{e}.{proj}.weight"] = deq
    sd = {k: twin.get(k, v) for k, v in src.items()}
    (tmp_path / "twin").mkdir()
    save_file(sd, str(tmp_path / "twin" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "twin" / "config.json").write_text((folders["src"] / "config.json").read_text())
    torch.testing.assert_close(_logits(llm, IDS), hf_logits(tmp_path / "twin", IDS), atol=1e-4, rtol=1e-4)


def test_other_quantized_modules_are_refused_clearly(folders, tmp_path):
    d = tmp_path / "e"
    d.mkdir()
    t = _tensors(folders["fp8"])
    t["backbone.layers.6.mixer.gate.weight"] = t["backbone.layers.6.mixer.gate.weight"].to(torch.float8_e4m3fn)
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text((folders["fp8"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"not linear layers or routed experts .* backbone.layers.6.mixer.gate"):
        LLM(d, dtype="float32", device=DEV)


def test_gpu_without_fp8_is_refused(monkeypatch):
    from hybrid_engine.quantization.config import QuantConfig, check_supported
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "A100")
    with pytest.raises(ValueError, match=r"needs a GPU with float8 support .* A100 has 8.0"):
        check_supported(QuantConfig("fp8", "online"), torch.device("cuda", 0), torch.bfloat16)


def test_hf_quant_config_json_alone_is_read(folders, tmp_path):
    d = tmp_path / "h"
    d.mkdir()
    (d / "model.safetensors").symlink_to(folders["fp8"] / "model.safetensors")
    (d / "hf_quant_config.json").write_text((folders["fp8"] / "hf_quant_config.json").read_text())
    cfg = json.loads((folders["fp8"] / "config.json").read_text())
    cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(d, dtype="float32", device=DEV, max_num_seqs=2)
    assert llm.engine.cfg.quantization.method == "fp8"
    assert isinstance(llm.engine.model.backbone.layers[0].mixer.in_proj, Fp8Linear)
