"""benchmarks/spec_rest.py on CPU with the tiny random-weight shape: every engine runs, its ratio
to no speculation and its steps by width are reported, and a method whose greedy tokens differ
from no speculation fails the run."""
import json

import pytest

from benchmarks import spec_rest


def test_spec_rest_reports_each_engine_against_none(tmp_path, monkeypatch):
    from hybrid_engine.spec.adaptive import AdaptiveDrafts
    untimed = []                                   # policies the --untimed cells stopped timing
    real_stop = AdaptiveDrafts.stop_timing
    monkeypatch.setattr(AdaptiveDrafts, "stop_timing", lambda self: (untimed.append(self), real_stop(self))[1])
    assert spec_rest.main(["--shape", "tiny", "--device", "cpu", "--tokens", "14", "--runs", "1", "--rounds", "1",
                           "--methods", "none,ngram", "--fixed", "--untimed", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "spec_rest.json").read_text())
    rows = {(r["method"], r["adaptive"]): r for r in data["rows"]}
    assert set(rows) == {("none", None), ("ngram", True), ("ngram", False), ("ngram", "untimed")}
    assert rows[("none", None)]["vs_none"] == 1.0
    for r in rows.values():
        assert r["s_per_token"] > 0 and r["vs_none"] > 0
        # 14 tokens per run: one prefill step (the first token) and 13 decode steps or fewer
        decode = sum(v["steps"] for k, v in r["steps_by_width"].items() if k.startswith("DecodeOnlyPlan"))
        assert 1 <= decode <= 13, r["steps_by_width"]
    # the fixed engine verifies K every decode step; no speculation verifies none
    assert all(k.endswith("/w3") for k in rows[("ngram", False)]["steps_by_width"] if k.startswith("Decode"))
    assert all(k.endswith("/w0") for k in rows[("none", None)]["steps_by_width"])
    md = (tmp_path / "spec_rest.md").read_text()
    assert "| ngram | on |" in md and "| ngram | off |" in md and "| ngram | untimed |" in md
    assert len(untimed) == 1 and untimed[0].costs is None and not untimed[0].times_steps


def test_spec_rest_markdown_takes_each_intervals_median_over_rounds():
    import argparse
    # the last round's interval (0.9) is not the median (0.5); M/w0 is timed in one round only
    rows = [dict(method="none", adaptive=None, s_per_token=t, vs_none=1.0, acceptance_length=1.0, round=i,
                 steps_by_width={"G/w0": {"steps": 9.0, "interval_ms": ms}, "M/w0": {"steps": 1.0, "interval_ms": m}})
            for i, (t, ms, m) in enumerate([(1e-3, 0.4, None), (2e-3, 0.5, 0.7), (3e-3, 0.9, None)])]
    rows.append(dict(rows[0], method="ngram", adaptive=True, round=0,
                     steps_by_width={"N/w0": {"steps": 2.0, "interval_ms": None}}))
    md = spec_rest.markdown(rows, argparse.Namespace(shape="tiny", dtype="float32", tokens=9, k=3, std=0.02,
                                                     runs=1, rounds=3), "cpu")
    assert "| none | - | 2.0000 | 1.00x | 1.00, 1.00, 1.00 | 1.00 | G/w0 9 (0.500), M/w0 1 (0.700) |" in md, md
    assert "| ngram | on |" in md and "N/w0 2 (-) |" in md, md


def test_spec_rest_fails_when_speculation_changes_the_tokens(tmp_path, monkeypatch):
    real = spec_rest.measure

    def wrong(target, draft, method, adaptive, args):
        row = real(target, draft, method, adaptive, args)
        if method != "none":
            row["tokens"] = list(row["tokens"][:-1]) + [row["tokens"][-1] + 1]
        return row
    monkeypatch.setattr(spec_rest, "measure", wrong)
    with pytest.raises(SystemExit, match="changed the greedy tokens"):
        spec_rest.main(["--shape", "tiny", "--device", "cpu", "--tokens", "6", "--runs", "1", "--rounds", "1",
                        "--methods", "none,ngram", "--out", str(tmp_path)])
