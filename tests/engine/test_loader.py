"""load_checkpoint: single file, shards + index, merged experts, errors that name the tensor."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hybrid_engine.models.loader import load_checkpoint
from hybrid_engine.models.synthetic import make_hf_model


class Tree(torch.nn.Module):
    """A module tree whose state_dict names are given (mimics our model's on-disk naming)."""

    def __init__(self, spec: dict[str, tuple[tuple[int, ...], bool]], device="meta"):
        super().__init__()
        for name, (shape, is_buffer) in spec.items():
            *path, leaf = name.split(".")
            mod = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            t = torch.zeros(shape, device=device)
            if is_buffer:
                mod.register_buffer(leaf, t)
            else:
                mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))


def _spec_of(model_dir, drop_prefix=None):
    spec = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                if drop_prefix and k.startswith(drop_prefix):
                    continue
                spec[k] = (tuple(h.get_slice(k).get_shape()), k.endswith("e_score_correction_bias"))
    return spec


def _disk(model_dir):
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("ld") / "m", "M-*E", n_routed_experts=3,
                         num_nextn_predict_layers=1, seed=3)


def _assert_loaded(model, disk, names=None):
    sd = model.state_dict()
    for k in names or sd:
        assert torch.equal(sd[k], disk[k].to(sd[k].dtype)), k


def test_single_file_meta_model_fp32_and_bf16(ckpt):
    disk = _disk(ckpt)
    spec = _spec_of(ckpt, drop_prefix="mtp.")       # model without MTP: mtp.* silently ignored
    m = load_checkpoint(Tree(spec), ckpt, torch.float32, "cpu")
    _assert_loaded(m, disk)
    assert all(t.device.type == "cpu" for t in m.state_dict().values())
    assert "backbone.layers.3.mixer.gate.e_score_correction_bias" in dict(m.named_buffers())

    m16 = load_checkpoint(Tree(spec), ckpt, torch.bfloat16, "cpu")
    for k, t in m16.state_dict().items():
        want = torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16
        assert t.dtype == want, k
        assert torch.equal(t, disk[k].to(want)), k


def test_existing_cpu_params_kept_dtype_when_dtype_none(ckpt):
    spec = _spec_of(ckpt, drop_prefix="mtp.")
    m = Tree(spec, device="cpu")
    m.backbone.layers.get_submodule("0.mixer").A_log.data = torch.zeros(8, dtype=torch.float64)
    load_checkpoint(m, ckpt, None, None)
    assert m.backbone.layers.get_submodule("0.mixer").A_log.dtype == torch.float64
    _assert_loaded(m, _disk(ckpt))


def test_model_with_mtp_loads_mtp(ckpt):
    m = load_checkpoint(Tree(_spec_of(ckpt)), ckpt, torch.float32, "cpu")
    _assert_loaded(m, _disk(ckpt))
    assert "mtp.layers.0.eh_proj.weight" in m.state_dict()


def test_strict_prefixes_loads_a_submodule(ckpt):
    spec = {k: v for k, v in _spec_of(ckpt).items() if k.startswith("mtp.")}
    spec["backbone.embeddings.weight"] = ((7, 7), False)        # outside the prefixes: left alone
    m = load_checkpoint(Tree(spec), ckpt, torch.float32, "cpu", strict_prefixes=("mtp.",),
                        tie_word_embeddings=False)
    _assert_loaded(m, _disk(ckpt), [k for k in spec if k.startswith("mtp.")])
    assert m.backbone.embeddings.weight.device.type == "meta"


def test_sharded_with_index(tmp_path, capsys):
    from hf_reference import load_hf
    src = make_hf_model(tmp_path / "src", "M*-E", seed=5)
    model = load_hf(src)
    dst = tmp_path / "sharded"
    model.save_pretrained(dst, max_shard_size="40KB")
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    m = load_checkpoint(Tree(_spec_of(dst)), dst, torch.float32, "cpu")
    _assert_loaded(m, _disk(src))
    assert "Loading weights" in capsys.readouterr().err       # tqdm bar over shards

    # no index: every *.safetensors in the folder is read
    (dst / "model.safetensors.index.json").unlink()
    m = load_checkpoint(Tree(_spec_of(dst)), dst, torch.float32, "cpu", progress=False)
    _assert_loaded(m, _disk(src))


def test_merged_experts_split_and_stacked(ckpt, tmp_path):
    disk = _disk(ckpt)
    merged = {}
    for k, v in disk.items():
        if ".experts." in k:
            head, rest = k.split(".experts.")
            e, w = rest.split(".")[:2]
            merged.setdefault(f"{head}.experts.{w}", {})[int(e)] = v
        else:
            merged[k] = v
    merged = {k: (torch.stack([v[e] for e in sorted(v)]) if isinstance(v, dict) else v) for k, v in merged.items()}
    d = tmp_path / "merged"
    d.mkdir()
    save_file(merged, str(d / "model.safetensors"))
    (d / "config.json").write_text((ckpt / "config.json").read_text())
    assert merged["backbone.layers.3.mixer.experts.up_proj"].shape == (3, 64, 64)
    # merged on disk -> per-expert model
    m = load_checkpoint(Tree(_spec_of(ckpt)), d, torch.float32, "cpu")
    _assert_loaded(m, disk)
    # per-expert on disk -> merged model parameter
    spec = {k: v for k, v in _spec_of(d).items()}
    m = load_checkpoint(Tree(spec), ckpt, torch.float32, "cpu")
    _assert_loaded(m, merged)


def test_tied_embeddings(tmp_path):
    d = make_hf_model(tmp_path / "tied", "M*", tie_word_embeddings=True)
    disk = _disk(d)
    assert torch.equal(disk["lm_head.weight"], disk["backbone.embeddings.weight"])
    spec = _spec_of(d)
    # lm_head.weight on disk equal to the embeddings, model shares them: the tie is kept
    shared = Tree(spec)
    shared.lm_head.weight = shared.backbone.embeddings.weight
    m = load_checkpoint(shared, d, torch.bfloat16, "cpu")
    assert m.lm_head.weight is m.backbone.embeddings.weight and m.lm_head.weight.dtype == torch.bfloat16
    _assert_loaded(m, disk)
    # a different lm_head.weight on disk: it is loaded and the model parameter untied
    other = dict(disk, **{"lm_head.weight": disk["lm_head.weight"] + 1})
    save_file(other, str(d / "model.safetensors"))
    shared = Tree(spec)
    shared.lm_head.weight = shared.backbone.embeddings.weight
    m = load_checkpoint(shared, d, torch.float32, "cpu")
    assert m.lm_head.weight is not m.backbone.embeddings.weight
    _assert_loaded(m, other)
    # no lm_head.weight on disk + tie_word_embeddings: lm_head shares the embeddings
    save_file({k: v for k, v in disk.items() if k != "lm_head.weight"}, str(d / "model.safetensors"))
    m = load_checkpoint(Tree(spec), d, torch.float32, "cpu")
    assert m.lm_head.weight is m.backbone.embeddings.weight
    assert torch.equal(m.lm_head.weight, disk["backbone.embeddings.weight"])
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_checkpoint(Tree(spec), d, torch.float32, "cpu", tie_word_embeddings=False)


def test_missing_tensors_named_and_truncated(ckpt):
    spec = _spec_of(ckpt, drop_prefix="mtp.")
    spec["backbone.layers.0.mixer.extra_weight"] = ((4,), False)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*backbone\.layers\.0\.mixer\.extra_weight"):
        load_checkpoint(Tree(spec), ckpt, torch.float32, "cpu")
    many = dict(spec, **{f"backbone.extra.{i:02d}": ((1,), False) for i in range(15)})
    with pytest.raises(ValueError, match=r"lacks 16 tensor.*\(6 more\)") as e:
        load_checkpoint(Tree(many), ckpt, torch.float32, "cpu")
    assert "backbone.extra.14" not in str(e.value)


def test_shape_mismatch_names_tensor(ckpt):
    spec = _spec_of(ckpt, drop_prefix="mtp.")
    spec["backbone.layers.2.mixer.q_proj.weight"] = ((64, 32), False)
    with pytest.raises(ValueError, match=r"backbone\.layers\.2\.mixer\.q_proj\.weight: expected \[64, 32\], "
                                         r"found \[64, 64\]"):
        load_checkpoint(Tree(spec), ckpt, torch.float32, "cpu")


def test_unexpected_tensor_named(ckpt):
    spec = _spec_of(ckpt, drop_prefix="mtp.")
    del spec["backbone.layers.0.mixer.D"]
    with pytest.raises(ValueError, match=r"does not have: backbone\.layers\.0\.mixer\.D"):
        load_checkpoint(Tree(spec), ckpt, torch.float32, "cpu")


def test_no_weights_and_bad_folder(tmp_path):
    with pytest.raises(ValueError, match=f"no \\*.safetensors weight files in {tmp_path}"):
        load_checkpoint(Tree({}), tmp_path, torch.float32, "cpu")
    with pytest.raises(ValueError, match="does not exist"):
        load_checkpoint(Tree({}), tmp_path / "nope", torch.float32, "cpu")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(ValueError, match="shard-1.safetensors"):
        load_checkpoint(Tree({}), tmp_path, torch.float32, "cpu")


def test_engine_model_loads_transformers_checkpoint(ckpt):
    from hybrid_engine.config import ModelConfig
    from hybrid_engine.models.nemotron_h import NemotronHForCausalLM

    with torch.device("meta"):
        model = NemotronHForCausalLM(ModelConfig.from_json(ckpt))
    load_checkpoint(model, ckpt, torch.bfloat16, "cpu")           # mtp.* on disk, no MTP module
    disk = _disk(ckpt)
    for k, t in model.state_dict().items():
        assert t.device.type == "cpu", k
        if k.endswith("e_score_correction_bias") or k.endswith("gate.weight"):   # the router is float32
            assert t.dtype == torch.float32
        if k.endswith(".experts.up_proj") or k.endswith(".experts.down_proj"):
            # per-expert on disk, stacked into the model's merged [E, out, in] parameter
            head, w = k.rsplit(".", 1)
            want = torch.stack([disk[f"{head}.{e}.{w}.weight"] for e in range(t.shape[0])])
        else:
            want = disk[k]
        assert torch.equal(t, want.to(t.dtype)), k
