"""The MoE benchmark's transformers baseline (benchmarks/moe.py ``--hf-batches``, through
``common.hf_twin`` and ``common.hf_greedy_decode``): transformers' model runs on the engine's own
weight tensors (assigned, not copied, so the full Nano shape fits one GPU once), and its greedy
tokens are the engine's on the tiny shape in float32."""
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.common import hf_greedy_decode, hf_twin, write_config
from benchmarks.moe import SHAPE_TINY, build_llm
from hybrid_engine import SamplingParams


def test_transformers_baseline_shares_every_tensor_and_agrees():
    md = write_config(Path(tempfile.mkdtemp()) / "m", SHAPE_TINY)
    llm = build_llm(md, torch.device("cpu"), torch.float32, 2, 256, 0.15)
    hf = hf_twin(llm.engine.model, md)
    ours = llm.engine.model.state_dict()          # (not the engine's own counters: expert_tokens)
    theirs = [*hf.named_parameters(), *hf.named_buffers()]
    assert len(theirs) == len(ours)
    for name, t in theirs:
        engine_name = "backbone." + name[len("model."):] if name.startswith("model.") else name
        assert t.data_ptr() == ours[engine_name].data_ptr(), f"{name} is a copy, not the engine's tensor"
    prompts = np.random.default_rng(0).integers(3, SHAPE_TINY["vocab_size"], (2, 24)).tolist()
    row = hf_greedy_decode(hf, prompts, 6)
    want = [list(o.outputs[0].token_ids) for o in
            llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)]
    assert row["tokens"] == want
    assert row["batch"] == 2 and row["tok_s"] > 0 and row["step_ms"] > 0


@pytest.mark.parametrize("argv", [["--hf-batches", "1", "--quantization", "fp8"],
                                  ["--batches", "1", "8", "--hf-batches", "4"]])
def test_bad_baseline_arguments_are_refused(argv, monkeypatch):
    import benchmarks.moe as moe
    monkeypatch.setattr("sys.argv", ["moe.py", "--device", "cpu", "--shape", "tiny", *argv])
    with pytest.raises(SystemExit) as e:
        moe.main()
    assert e.value.code == 2


def test_first_token_gaps_place_the_engines_pick_in_transformers_logits():
    """``first_token_gaps``: 0 where the engine picked transformers' top-1; a wrong pick (the top-2
    token, here) reads as transformers' own top-1 minus top-2 gap."""
    from benchmarks.moe import first_token_gaps
    md = write_config(Path(tempfile.mkdtemp()) / "m", SHAPE_TINY)
    llm = build_llm(md, torch.device("cpu"), torch.float32, 2, 256, 0.15)
    hf = hf_twin(llm.engine.model, md)
    prompts = np.random.default_rng(1).integers(3, SHAPE_TINY["vocab_size"], (2, 16)).tolist()
    with torch.no_grad():
        logits = hf(torch.tensor(prompts)).logits[:, -1]
    top = logits.topk(2, dim=-1)
    same = first_token_gaps(hf, prompts, top.indices[:, 0].tolist())
    assert same["engine_pick_gap"] == [0.0, 0.0]
    second = first_token_gaps(hf, prompts, top.indices[:, 1].tolist())
    assert second["engine_pick_gap"] == second["hf_top2_gap"] and min(second["hf_top2_gap"]) > 0
