"""``LLM.generate``'s progress bar moves as requests finish (not only at the end) and shows live
input/output tokens/s, reading only host-side request fields."""
import hybrid_engine.llm as llm_mod
from hybrid_engine import LLM, SamplingParams


class _Recorder:
    """Stands in for tqdm: records (n, postfix) at every draw."""
    draws: list = []

    def __init__(self, total, **kw):
        self.total, self.n, self.postfix = total, 0, ""
        _Recorder.draws = []

    def set_postfix_str(self, s, refresh=True):
        self.postfix = s

    def update(self, k):
        self.n += k
        self.refresh()

    def refresh(self):
        _Recorder.draws.append((self.n, self.postfix))

    def close(self):
        pass


def test_bar_moves_as_requests_finish(hybrid_dir, monkeypatch):
    monkeypatch.setattr(llm_mod, "tqdm", _Recorder)
    monkeypatch.setattr(llm_mod._Progress, "REFRESH_S", 0.0)          # draw at every step
    llm = LLM(hybrid_dir, dtype="float32", device="cpu", max_num_seqs=4, async_scheduling=False)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 6, 12)]
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 6, 12]
    draws = _Recorder.draws
    counts = [n for n, _ in draws]
    assert counts == sorted(counts) and counts[-1] == 3
    assert 1 in counts and 2 in counts                      # moved while other requests still ran
    first_done = next(p for n, p in draws if n == 1)
    assert "input:" in first_done and "output:" in first_done
    out_rate = float(first_done.split("output: ")[1].split(" ")[0])
    in_rate = float(first_done.split("input: ")[1].split(" ")[0])
    assert out_rate > 0 and in_rate > 0


def test_no_bar_no_polling(hybrid_dir, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("progress built with use_tqdm=False")
    monkeypatch.setattr(llm_mod, "_Progress", boom)
    llm = LLM(hybrid_dir, dtype="float32", device="cpu")
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids) == 3
