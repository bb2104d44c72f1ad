"""``hybrid-engine serve`` without the serve extra says what to install; its arguments map onto
the engine's."""
import sys

import pytest

from hybrid_engine.cli import main


def test_serve_without_extra_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)      # as if not installed
    assert main(["serve", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "missing: uvicorn" in err and "pip install 'hybrid-engine[serve]'" in err


def test_serve_arguments(monkeypatch):
    import hybrid_engine.server.cli as scli
    seen = {}

    def fake_run(args):
        seen.update(vars(args))
        return 0
    monkeypatch.setattr(scli, "run_serve", fake_run)
    assert main(["serve", "some/dir", "--spec", "ngram", "--num-speculative-tokens", "4", "--max-num-seqs", "8",
                 "--max-waiting-requests", "3", "--api-key", "k", "--kv-cache-dtype", "fp8"]) == 0
    assert seen["model"] == "some/dir" and seen["spec"] == "ngram" and seen["num_spec_tokens"] == 4
    assert seen["max_num_seqs"] == 8 and seen["max_waiting_requests"] == 3 and seen["api_key"] == "k"
    assert seen["host"] == "127.0.0.1"
    # the engine arguments reach AsyncLLM(...) as LLM(...) takes them
    import argparse
    import hybrid_engine
    got = {}
    monkeypatch.setattr(hybrid_engine, "AsyncLLM", lambda model, **kw: got.update(kw, model=model))
    scli.build_llm(argparse.Namespace(**seen))
    assert got["model"] == "some/dir" and got["kv_cache_dtype"] == "fp8" and got["max_num_seqs"] == 8
    assert got["enable_prefix_caching"] is True                    # on by default, as LLM(...)
    seen.clear()
    assert main(["serve", "some/dir", "--no-enable-prefix-caching"]) == 0
    assert seen["enable_prefix_caching"] is False


def test_serve_draft_options(monkeypatch):
    """``--draft-vocab-size`` and ``--draft-quantization`` reach the SpeculativeConfig; without
    ``--spec`` they are refused."""
    import argparse
    import hybrid_engine
    import hybrid_engine.server.cli as scli
    seen, got = {}, {}
    monkeypatch.setattr(scli, "run_serve", lambda args: seen.update(vars(args)) or 0)
    monkeypatch.setattr(hybrid_engine, "AsyncLLM", lambda model, **kw: got.update(kw, model=model))
    assert main(["serve", "some/dir", "--spec", "mtp", "--draft-vocab-size", "64", "--draft-quantization", "fp8"]) == 0
    scli.build_llm(argparse.Namespace(**seen))
    spec = got["speculative_config"]
    assert (spec.method, spec.draft_vocab_size, spec.quantization) == ("mtp", 64, "fp8")
    seen.clear()
    assert main(["serve", "some/dir", "--draft-quantization", "fp8"]) == 0
    with pytest.raises(ValueError, match="--draft-vocab-size and --draft-quantization need --spec"):
        scli.build_llm(argparse.Namespace(**seen))


def test_warm_up_runs_on_cuda_unless_turned_off(monkeypatch):
    """``serve`` warms up on CUDA by default (``--no-warmup`` skips it) and never on the CPU."""
    import argparse
    import types

    import torch
    import hybrid_engine.server.cli as scli
    import hybrid_engine.warmup as warmup
    seen = {}
    monkeypatch.setattr(scli, "run_serve", lambda args: seen.update(vars(args)) or 0)
    main(["serve"])
    assert seen["warmup"] is True
    main(["serve", "--no-warmup"])
    assert seen["warmup"] is False
    ran = []
    monkeypatch.setattr(warmup, "warm_up", lambda engine, seed: ran.append((engine, seed)))

    def llm(device):
        return types.SimpleNamespace(engine=types.SimpleNamespace(cfg=types.SimpleNamespace(device=torch.device(device))))
    cuda, cpu = llm("cuda"), llm("cpu")
    assert scli.maybe_warm_up(cuda, argparse.Namespace(warmup=True, seed=7)) and ran == [(cuda.engine, 7)]
    assert not scli.maybe_warm_up(cuda, argparse.Namespace(warmup=False, seed=7))
    assert not scli.maybe_warm_up(cpu, argparse.Namespace(warmup=True, seed=7)) and len(ran) == 1


def test_prefix_caching_switch_of_generate_and_bench(monkeypatch):
    """``generate`` / ``chat`` / ``bench`` build their engine with caching on unless
    ``--no-enable-prefix-caching``; ``bench`` turns it off itself (its timed runs repeat prompts)."""
    import hybrid_engine
    from hybrid_engine import bench
    from hybrid_engine.cli import _llm, build_parser
    seen = []

    class Stop(Exception):
        pass

    def fake_llm(model, **kw):
        seen.append(kw["enable_prefix_caching"])
        raise Stop
    monkeypatch.setattr(hybrid_engine, "LLM", fake_llm)
    p = build_parser()
    for argv, want in ((["generate"], True), (["generate", "--no-enable-prefix-caching"], False),
                       (["chat", "--enable-prefix-caching"], True)):
        with pytest.raises(Stop):
            _llm(p.parse_args(argv))
        assert seen.pop() is want
    with pytest.raises(Stop):
        bench.run_cli(p.parse_args(["bench", "--enable-prefix-caching"]))
    assert seen.pop() is False
