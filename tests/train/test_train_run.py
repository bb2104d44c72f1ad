"""A ``--preset tiny`` training run on CPU (a few steps): the output layout, folders that load in
transformers and in our engine with equal held-out losses (float32), the MTP step saved in the
published layout computing what the training-time head computes (our MTP drafter's proposals are
the head's argmax), and a bitwise-reproducible run for a given seed."""
import json
import math

import pytest
import torch

from benchmarks.train.__main__ import main
from benchmarks.train.evaluate import engine_llm, engine_prefill_hidden, heldout_windows
from benchmarks.train.models import load_target_with_mtp

ARGS = ["--preset", "tiny", "--device", "cpu", "--seed", "3", "--no-progress", "--log-every", "2"]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_run")
    assert main([*ARGS, "--out", str(d)]) == 0
    return d


@pytest.fixture(scope="module")
def report(out):
    return json.loads((out / "train_report.json").read_text())


def _window_ids(out, n_tokens):
    """The first n_tokens token ids of the held-out files, concatenated."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(out / "target"))
    ids = []
    for path in json.loads((out / "heldout_files.json").read_text()):
        ids += tok(open(path, encoding="utf-8").read(), add_special_tokens=False)["input_ids"]
        if len(ids) >= n_tokens:
            break
    assert len(ids) >= n_tokens
    return ids[:n_tokens]


def test_layout_and_report(out, report):
    for sub in ("target", "draft"):
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            assert (out / sub / name).is_file(), f"{sub}/{name}"
    held = json.loads((out / "heldout_files.json").read_text())
    assert held and all(p.startswith("/") for p in held) and len(held) == report["corpus"]["heldout_files"]
    assert report["steps"] == 4 and report["tokens_seen"] == 4 * 4 * 32
    assert report["params"]["target"] > 0 and report["params"]["target_mtp"] > 0 and report["params"]["draft"] > 0
    assert [h["step"] for h in report["history"]] == [2, 4]
    assert report["corpus"]["train_files"] > 0 and report["corpus"]["train_bytes"] > 0
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["mtp_layers_block_type"] == ["full_attention", "moe"]
    assert cfg["time_step_limit"][0] == cfg["time_step_min"]
    assert set(cfg["layers_block_type"]) == {"linear_attention", "mlp", "full_attention", "moe"}
    from safetensors import safe_open
    with safe_open(str(out / "target" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.hnorm.weight", "mtp.layers.0.eh_proj.weight",
            "mtp.layers.0.mixer.q_proj.weight", "mtp.layers.1.mixer.gate.weight",
            "mtp.layers.1.mixer.experts.0.up_proj.weight", "mtp.layers.1.final_layernorm.weight"} <= names


def test_heldout_loss_transformers_equals_engine(out, report):
    h = report["heldout_loss"]
    assert h["uniform"] == pytest.approx(math.log(report["vocab_size"]))
    for m in ("target", "draft"):
        assert h["engine"][m] == pytest.approx(h["transformers"][m], abs=1e-4), m
        assert h["engine"][m] == pytest.approx(h["training_modules"][m], abs=1e-4), m
    assert h["engine"]["mtp"] == pytest.approx(h["training_modules"]["mtp"], abs=1e-4)
    # (after 4 steps the losses are near uniform; the per-position test below compares spread logits)


@pytest.mark.parametrize("which", ["target", "draft"])
def test_per_position_logits_transformers_equals_engine(out, which):
    from transformers import AutoModelForCausalLM
    ids = _window_ids(out, 40)
    hf = AutoModelForCausalLM.from_pretrained(str(out / which), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    llm = engine_llm(out / which, "cpu", len(ids))
    with torch.inference_mode():
        got = llm.engine.model.compute_logits(engine_prefill_hidden(llm, ids))
    assert ref.std() > 0.1                                  # logits far from flat
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


def test_mtp_drafter_proposes_the_training_head_argmax(out):
    """Our engine's MTP drafter (K=1, its KV-cached MTP pass) proposes, right after each prefill,
    exactly the argmax of the training-time MTP head on the same sequence."""
    from hybrid_engine import SamplingParams
    from hybrid_engine.spec.drafters import mtp as mtp_mod

    head = load_target_with_mtp(out / "target")
    text = _window_ids(out, 30)
    recorded = []
    orig = mtp_mod.MTPDrafter.propose

    def record(self, ctx):
        drafts, probs = orig(self, ctx)
        recorded.append(drafts.clone())
        return drafts, probs
    mtp_mod.MTPDrafter.propose = record
    checked = 0
    try:
        llm = engine_llm(out / "target", "cpu", 40, mtp=True)
        for p in (3, 9, 17, 26):
            recorded.clear()
            o = llm.generate([text[:p]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
            seq = text[:p] + o.outputs[0].token_ids[:1]          # prompt + the token sampled at prefill
            with torch.no_grad():
                ids = torch.tensor([seq])
                hidden = head.lm.model(input_ids=ids[:, :-1]).last_hidden_state     # h_0..h_{p-1}
                logits = head.mtp_logits(hidden, ids[:, 1:])                         # pairs 0..p-1
            assert recorded, "the MTP drafter proposed nothing"
            assert recorded[0][0, 0].item() == logits[0, -1].argmax().item(), p
            checked += 1
    finally:
        mtp_mod.MTPDrafter.propose = orig
    assert checked == 4


def test_training_is_reproducible_for_a_seed(out, report, tmp_path):
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    again = json.loads((tmp_path / "train_report.json").read_text())
    assert again["history"] == [{**h, "time_s": g["time_s"]} for h, g in zip(report["history"], again["history"])]
    for sub in ("target", "draft"):
        assert (tmp_path / sub / "model.safetensors").read_bytes() == (out / sub / "model.safetensors").read_bytes()
    assert (tmp_path / "heldout_files.json").read_text() == (out / "heldout_files.json").read_text()


def test_bad_arguments():
    with pytest.raises(SystemExit):
        main(["--preset", "huge", "--out", "/tmp/x"])
    with pytest.raises(SystemExit, match="max-steps"):
        main(["--preset", "tiny", "--out", "/tmp/x", "--max-steps", "0"])


def test_heldout_windows_need_a_window():
    with pytest.raises(ValueError, match="heldout"):
        heldout_windows(torch.arange(5), 8, 2)


def test_bf16_autocast_refused_off_cuda_before_any_work(tmp_path):
    """bench-large trains under bf16 autocast, which is CUDA-only: refused up front on CPU (naming
    the preset and the way out), before the corpus or tokenizer is built."""
    with pytest.raises(ValueError, match="'bench-large'.*--no-bf16-autocast"):
        main(["--preset", "bench-large", "--device", "cpu", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="CUDA training only"):
        main(["--preset", "tiny", "--bf16-autocast", "--device", "cpu", "--out", str(tmp_path / "y")])


def test_copy_windows_repeat_a_piece_of_the_stream():
    """Each copy window is the stream from its start (width - L tokens: a prefix, a piece of L
    tokens, the text after it) followed by the piece again; L in [min_piece, width // 2], the
    piece anywhere in the natural part; the same rows for the same seed."""
    from benchmarks.train.train import copy_windows
    stream = torch.randperm(5000)                       # distinct ids: a token's source is unique
    starts = torch.tensor([0, 17, 4000, 4487, 100, 2000, 3000, 1234])
    width = 513
    rows, pieces = copy_windows(stream, starts, width, torch.Generator().manual_seed(1))
    again, _ = copy_windows(stream, starts, width, torch.Generator().manual_seed(1))
    assert rows.shape == (8, width) and torch.equal(rows, again)
    lengths, gaps = set(), set()
    for row, s, piece in zip(rows, starts.tolist(), pieces):
        m = next(i for i in range(width) if row[i] != stream[s + i])     # the natural part's length
        n = width - m
        assert 16 <= n <= width // 2 and n == piece                     # the returned piece length
        assert torch.equal(row[:m], stream[s:s + m])
        pre = int((stream[s:s + m] == row[m]).nonzero()[0])                # where the piece starts
        assert torch.equal(row[m:], row[pre:pre + n])                   # the piece, copied
        lengths.add(n)
        gaps.add(m - pre - n)
    assert len(lengths) > 1 and len(gaps) > 1 and min(gaps) >= 0        # drawn per row
    with pytest.raises(ValueError, match="width"):
        copy_windows(stream, starts, 20, torch.Generator())


def test_copy_frac_refused_out_of_range_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="copy_frac"):
        main([*ARGS, "--copy-frac", "1.5", "--out", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def _repeats_a_piece(row: torch.Tensor, min_piece: int = 16) -> bool:
    """Whether the row ends with a copy (>= min_piece tokens) of a run of tokens earlier in it."""
    w = row.numel()
    for n in range(min_piece, w // 2 + 1):
        if bool((row[:w - n].unfold(0, n, 1) == row[w - n:]).all(1).any()):
            return True
    return False


def test_copy_frac_changes_the_training_batches(out, report, tmp_path, monkeypatch):
    """--copy-frac replaces the first rows of each batch with copy windows (seen by the model: the
    first training batch is captured), the same seed gives a different loss history, and the
    report records the share and the row count."""
    from benchmarks.train import models
    batches, losses = [], models.TargetWithMTP.losses

    def spy(self, window):
        batches.append(window.detach().cpu().clone())
        return losses(self, window)
    monkeypatch.setattr(models.TargetWithMTP, "losses", spy)
    assert report["config"]["copy_frac"] == 0.0
    assert main([*ARGS, "--copy-frac", "0.5", "--out", str(tmp_path)]) == 0
    copied = json.loads((tmp_path / "train_report.json").read_text())
    assert copied["config"]["copy_frac"] == 0.5 and copied["config"]["copy_rows_per_batch"] == 2
    first = batches[0]                                   # [batch 4, 33] of the tiny preset
    assert first.shape[0] == 4 and all(_repeats_a_piece(r) for r in first[:2])
    # the held-out losses are still scored on the held-out windows (not on a training batch)
    assert copied["heldout_loss"]["windows"] == report["heldout_loss"]["windows"] == 2
    assert copied["heldout_loss"]["transformers"] != report["heldout_loss"]["transformers"]
    assert 0.0 < report["heldout_loss"]["copy_target"] < 2 * report["heldout_loss"]["uniform"]
    assert [h["target"] for h in copied["history"]] != [h["target"] for h in report["history"]]


def test_heldout_copy_loss_scores_the_copies_after_their_first_token():
    """An induction oracle (predicts the token that followed the latest earlier occurrence of the
    current token; uniform where there is none) copies perfectly: on a stream of distinct ids it
    is right on every copied token but the first, so its copy loss is ~0. Scoring the copy's first
    token too, or natural tokens, would give ~log V."""
    from types import SimpleNamespace

    from benchmarks.train.train import heldout_copy_loss
    V = 3000

    def lm(input_ids):
        ids = input_ids[0].tolist()
        logits = torch.zeros(1, len(ids), V)
        last = {}
        for i, t in enumerate(ids):
            if t in last:
                logits[0, i, ids[last[t] + 1]] = 50.0
            last[t] = i
        return SimpleNamespace(logits=logits)

    target = SimpleNamespace(lm=lm, eval=lambda: None, train=lambda: None)
    stream = torch.randperm(V)
    loss = heldout_copy_loss(target, stream, 65, 6, "cpu")
    assert 0.0 <= loss < 1e-3
    assert math.log(V) - 0.5 < heldout_copy_loss(SimpleNamespace(lm=lambda input_ids: SimpleNamespace(
        logits=torch.zeros(1, input_ids.shape[1], V)), eval=lambda: None, train=lambda: None), stream, 65, 6, "cpu")
    with pytest.raises(ValueError, match="windows"):
        heldout_copy_loss(target, stream[:10], 65, 1, "cpu")
