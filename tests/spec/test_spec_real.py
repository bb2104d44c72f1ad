"""benchmarks/spec_real.py end to end on CPU with tiny sizes: every cell runs, greedy outputs are
checked against no speculation, and the forced-acceptance phase runs at the measured rates."""
import json

import pytest

from benchmarks import spec_real
from benchmarks.spec_shapes import shape_dirs

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


class Box:
    def __init__(self, width, height):
        self.width, self.height = width, height

    def area(self):
        return area(self.width, self.height)
'''


@pytest.fixture
def files(tmp_path):
    d = tmp_path / "heldout"
    d.mkdir()
    for i in range(2):
        (d / f"mod{i}.py").write_text(CODE.replace("Box", f"Box{i}") * 3)
    (d / "tiny.py").write_text("x = 1\n")                    # too short: skipped
    return d


def test_spec_real_smoke(files, tmp_path):
    out = tmp_path / "out"
    rc = spec_real.main(["--device", "cpu", "--dtype", "float32", "--files", str(files),
                         "--methods", "none,ngram,mtp", "--ks", "2", "--batches", "1,2", "--b1-prompts", "2",
                         "--workloads", "completion,edit,sample", "--prompt-tokens", "40", "--max-tokens", "12",
                         "--repeats", "1", "--forced-shapes", "tiny", "--forced-k", "2", "--forced-batches", "1",
                         "--forced-prompt-tokens", "6", "--forced-max-tokens", "6", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "spec_real.json").read_text())
    real = data["real"]
    cells = {(r["workload"], r["method"], r["batch"]) for r in real}
    assert cells == {(w, m, b) for w in ("completion", "edit", "sample") for m in ("none", "ngram", "mtp")
                     for b in (1, 2)}
    for r in real:
        # batch 1 decodes both prompts, one after the other
        assert r["prompts"] == (2 if r["batch"] == 1 else r["batch"])
        assert r["tokens"] == 12 * r["prompts"] and r["tok_s"] > 0 and r["speedup"] > 0
        assert 0 < r["tpot_s"] < r["seconds"] and r["decode_speedup"] > 0
        # batch 1: one request after another; a batch's requests wait for each other's prefills
        assert 0 < r["ttft_s"] < (r["seconds"] / r["prompts"] if r["batch"] == 1 else r["seconds"])
        if r["method"] != "none":
            assert len(r["per_position"]) == 2 and r["acceptance_length"] >= 1.0
            if r["workload"] != "sample":
                assert r["greedy_equal"] is True
    forced = data["forced"]
    assert {(r["shape"], r["method"]) for r in forced} == {("tiny", "none"), ("tiny", "ngram"), ("tiny", "mtp")}
    assert all(r["forced_rate"] == data["meta"]["forced_rates"][r["method"]] for r in forced if r["method"] != "none")
    md = (out / "spec_real.md").read_text()
    assert "| edit | ngram | 2 | 1 |" in md and "Forced acceptance" in md


def test_edit_prompts_restart_the_piece_they_copy(files):
    """Workload (b): prompt = a piece of a file, the separator, then the piece's first quarter
    again, so the continuation the file implies is a copy of text in the prompt."""
    from hybrid_engine.default_model import default_model_dir
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    prompts = spec_real.build_prompts(tok, spec_real.heldout_files(spec_real.parse_args(
        ["--files", str(files), "--out", "x"])), 3, 40, 12)
    assert len(prompts["completion"]) == 3 and prompts["sample"] == prompts["completion"]
    for comp, edit in zip(prompts["completion"], prompts["edit"]):
        assert len(comp) == 40
        text = tok.decode(edit)
        head, tail = text.split(spec_real.EDIT_SEPARATOR.strip(), 1)
        assert tail.strip() and tail.strip() in head            # the restart copies the piece


def test_mean_tpot_excludes_the_first_token():
    """TPOT = (finish - first token) / (tokens - 1) per request, averaged; a one-token request
    (no decode step) takes no part."""
    from benchmarks.spec_timing import mean_tpot
    from hybrid_engine.outputs import CompletionOutput, RequestOutput

    def out(n, first, finish):
        return RequestOutput("r", [1], [CompletionOutput(0, list(range(n)), None, "length")], True,
                             metrics={"arrival_time": 0.0, "first_token_time": first, "finish_time": finish})
    assert mean_tpot([out(11, 5.0, 6.0), out(5, 1.0, 3.0)]) == pytest.approx((0.1 + 0.5) / 2)
    assert mean_tpot([out(1, 2.0, 2.0), out(3, 1.0, 2.0)]) == pytest.approx(0.5)
    assert mean_tpot([out(1, 2.0, 2.0)]) is None


def test_mean_ttft_is_arrival_to_first_token():
    from benchmarks.spec_timing import mean_ttft
    from hybrid_engine.outputs import CompletionOutput, RequestOutput

    def out(arrival, first):
        return RequestOutput("r", [1], [CompletionOutput(0, [1, 2], None, "length")], True,
                             metrics={"arrival_time": arrival, "first_token_time": first, "finish_time": first + 1})
    assert mean_ttft([out(1.0, 1.5), out(2.0, 2.1)]) == pytest.approx(0.3)
    assert mean_ttft([]) is None


def test_bench_large_shape_is_the_trained_presets_target_and_draft(tmp_path):
    """``--shape bench-large`` (spec_step_cost, --forced-shapes) writes the bench-large preset's
    target with its MTP block (attention + MoE) and the preset's draft, at its vocabulary: the step
    costs of the trained benchmark's models, measured with random weights."""
    from hybrid_engine.config import ATTENTION, MOE, ModelConfig
    from benchmarks.train.models import PRESETS
    p = PRESETS["bench-large"]
    target, draft = shape_dirs("bench-large", tmp_path)
    t, d = ModelConfig.from_json(target), ModelConfig.from_json(draft)
    assert t.hidden_size == p.target["hidden_size"] and t.vocab_size == d.vocab_size == p.vocab_size
    assert len(t.layer_types) == len(p.target["pattern"]) and t.num_nextn_predict_layers == 1
    assert tuple(t.mtp_layer_types) == (ATTENTION, MOE), t.mtp_layer_types
    assert d.hidden_size == p.draft["hidden_size"] and len(d.layer_types) == len(p.draft["pattern"])


def test_untimed_runs_the_acceptance_rule_alone(files, tmp_path, monkeypatch):
    """``--adaptive untimed`` (the gate off, for a same-run comparison with ``on``): each speculative
    engine's policy stops timing before its cells run; no speculation has no policy to stop."""
    from hybrid_engine.spec.adaptive import AdaptiveDrafts
    stopped = []
    real_stop = AdaptiveDrafts.stop_timing
    monkeypatch.setattr(AdaptiveDrafts, "stop_timing", lambda self: (stopped.append(self), real_stop(self))[1])
    rc = spec_real.main(["--device", "cpu", "--dtype", "float32", "--files", str(files), "--methods", "none,ngram",
                         "--ks", "2", "--batches", "1", "--b1-prompts", "1", "--workloads", "completion",
                         "--prompt-tokens", "40", "--max-tokens", "6", "--repeats", "1", "--adaptive", "untimed",
                         "--out", str(tmp_path / "out")])
    assert rc == 0
    assert len(stopped) == 1 and stopped[0].costs is None and not stopped[0].times_steps


def _cell(method, speedup, equal=True, **kw):
    return dict(workload="edit", method=method, k=0 if method == "none" else 3, batch=1, speedup=speedup,
                decode_speedup=speedup * 1.1, tok_s=100.0 * speedup, tpot_s=0.01 / speedup, ttft_s=0.005,
                seconds=1.0 / speedup, acceptance_length=1.0 if method == "none" else 2.0 + speedup,
                **({} if method == "none" else {"greedy_equal": equal}), **kw)


def test_merge_rounds_takes_medians_of_in_round_ratios_and_every_rounds_equality():
    from benchmarks.spec_report import markdown, merge_rounds
    rounds = [[_cell("none", 1.0, per_position=[]), _cell("mtp", s, equal=e, per_position=[0.5, 0.2, 0.1])]
              for s, e in ((1.3, True), (1.1, True), (1.6, False))]
    none, mtp = merge_rounds(rounds)
    assert none["speedup"] == 1.0 and none["rounds"] == 3 and "greedy_equal" not in none
    assert mtp["speedup"] == 1.3 and mtp["speedup_by_round"] == [1.3, 1.1, 1.6]
    assert mtp["decode_speedup"] == 1.3 * 1.1 and mtp["acceptance_length"] == 2.0 + 1.3
    assert mtp["greedy_equal"] is False                       # one round's outputs differed
    assert mtp["per_position"] == [0.5, 0.2, 0.1]             # round 1's
    assert merge_rounds(rounds[:1]) is rounds[0]              # one round: its rows as they are
    md = markdown([none, mtp], [], dict(device="cpu", target="t", adaptive="on", prompt_tokens=8, max_tokens=4,
                                        repeats=1, rounds=3, b1_prompts=1))
    assert "| edit | mtp | 3 | 1 | 130.0 | 1.30x (1.30, 1.10, 1.60) |" in md and "3 rounds" in md
    with pytest.raises(ValueError, match="same cells"):
        merge_rounds([rounds[0], rounds[1][::-1]])


def test_spec_real_rounds_rebuild_the_sweep(files, tmp_path):
    out = tmp_path / "out"
    rc = spec_real.main(["--device", "cpu", "--dtype", "float32", "--files", str(files), "--methods", "none,ngram",
                         "--ks", "2", "--batches", "1", "--b1-prompts", "1", "--workloads", "edit",
                         "--prompt-tokens", "40", "--max-tokens", "8", "--repeats", "1", "--rounds", "2",
                         "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "spec_real.json").read_text())
    assert data["meta"]["rounds"] == 2
    none, ngram = data["real"]
    for r in (none, ngram):
        assert r["rounds"] == 2 and len(r["speedup_by_round"]) == 2 and len(r["tok_s_by_round"]) == 2
    assert none["speedup_by_round"] == [1.0, 1.0]
    assert ngram["speedup"] == pytest.approx(sum(ngram["speedup_by_round"]) / 2)   # the median of two
    assert ngram["greedy_equal"] is True
