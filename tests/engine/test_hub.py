"""LLM(model="owner/name") resolves a Hugging Face Hub repo id through huggingface_hub; offline
(HF_HUB_OFFLINE=1) it uses the local Hub cache, laid out here as the Hub lays it out
(models--owner--name/{blobs, refs/main, snapshots/<commit>/ with links into blobs})."""
import hashlib
import os

import pytest

from hf_reference import hf_greedy
from hybrid_engine import LLM, SamplingParams
from hybrid_engine.hub import looks_like_repo_id, resolve_model_dir
from hybrid_engine.models.synthetic import make_hf_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lay_out_hub_cache(cache, repo_id, src):
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir()
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_repo_id_loads_from_offline_cache(tmp_path, offline_hub):
    src = make_hf_model(tmp_path / "src", pattern="M*-", seed=6)
    snap = _lay_out_hub_cache(offline_hub, "nvidia/Tiny-Nemotron-H", src)
    assert resolve_model_dir("nvidia/Tiny-Nemotron-H") == snap
    llm = LLM("nvidia/Tiny-Nemotron-H", dtype="float32", device="cpu", max_num_seqs=1)
    prompt = [4, 8, 15, 16, 23, 42]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(src, [prompt], 5)[0]


def test_repo_id_not_cached_offline(offline_hub):
    with pytest.raises(ValueError, match=r"'nvidia/Not-There' is not a local folder and was not found in "
                                         r"the local Hub cache \(HF_HUB_OFFLINE=1\)"):
        LLM("nvidia/Not-There", device="cpu")


@pytest.mark.parametrize("path", ["/no/such/folder", "./missing-model", "~/nope/a/b", "a/b/c"])
def test_missing_folder_says_so(path, offline_hub):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(path, device="cpu")


def test_file_is_not_a_folder(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{}")
    with pytest.raises(ValueError, match="is a file, not a model folder"):
        LLM(str(f), device="cpu")


def test_repo_id_shape():
    assert looks_like_repo_id("nvidia/NVIDIA-Nemotron-Nano-9B-v2")
    assert not looks_like_repo_id("/abs/path")
    assert not looks_like_repo_id("a/b/c")
    assert not looks_like_repo_id("../x")
