"""LLM.chat / AsyncLLM.chat render with the tokenizer's own chat template (flags such as
enable_thinking included) and generate exactly what generate() gives for the rendered ids;
``hybrid-engine chat`` streams replies to lines read from stdin."""
import asyncio
import io
import sys

import pytest

from hybrid_engine import LLM, AsyncLLM, SamplingParams
from hybrid_engine.models.synthetic import make_hf_model

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The river ran through"}]
GREEDY = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("chat") / "m", pattern="M*-", seed=4, vocab_size=512,
                         with_tokenizer=True)


@pytest.fixture(scope="module")
def llm(chat_dir):
    return LLM(chat_dir, dtype="float32", device="cpu", max_num_seqs=2)


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_chat_uses_the_template_and_its_flags(llm):
    tok = llm.tokenizer
    on = "<|system|>\nBe brief.\n<|user|>\nThe river ran through\n<|assistant|>\n<think>\n"
    off = on[: -len("<think>\n")] + "<think></think>"
    for kwargs, text in ((None, on), ({"enable_thinking": False}, off)):
        out = llm.chat(CONV, GREEDY, chat_template_kwargs=kwargs, use_tqdm=False)
        assert len(out) == 1
        assert out[0].prompt_token_ids == _ids(tok, text)
        plain = llm.generate([_ids(tok, text)], GREEDY, use_tqdm=False)[0]
        assert out[0].outputs[0].token_ids == plain.outputs[0].token_ids


def test_chat_batch_of_conversations(llm):
    other = [{"role": "user", "content": "Once upon a time"}]
    outs = llm.chat([CONV, other], GREEDY, use_tqdm=False)
    singles = [llm.chat(c, GREEDY, use_tqdm=False)[0] for c in (CONV, other)]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in singles]
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids


@pytest.mark.parametrize("messages,kwargs,match", [
    ([], None, "messages must be a non-empty list"),
    ("hello", None, "messages must be a non-empty list"),
    ([{"content": "x"}], None, r"messages\[0\] needs a 'role'"),
    ([{"role": "user", "content": 5}], None, r"messages\[0\]\['content'\] must be a string"),
    (CONV, ["enable_thinking"], "chat_template_kwargs must be a dict"),
])
def test_chat_bad_input(llm, messages, kwargs, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GREEDY, chat_template_kwargs=kwargs, use_tqdm=False)
    assert not llm.engine.has_work()


def test_chat_without_template(tmp_path):
    d = make_hf_model(tmp_path / "m", pattern="M*", vocab_size=512, with_tokenizer=True)
    cfg = d / "tokenizer_config.json"
    import json
    data = json.loads(cfg.read_text())
    data.pop("chat_template", None)
    cfg.write_text(json.dumps(data))
    (d / "chat_template.jinja").unlink(missing_ok=True)
    llm = LLM(d, dtype="float32", device="cpu", max_num_seqs=1)
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat(CONV, GREEDY, use_tqdm=False)


def test_async_chat_streams_the_same_tokens(chat_dir, llm):
    want = llm.chat(CONV, GREEDY, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]

    async def run():
        async with AsyncLLM(chat_dir, dtype="float32", device="cpu", max_num_seqs=2) as eng:
            toks, text = [], ""
            async for d in eng.chat(CONV, GREEDY, chat_template_kwargs={"enable_thinking": False}):
                toks += d.outputs[0].token_ids
                text += d.outputs[0].text
            with pytest.raises(ValueError, match="one conversation"):
                async for _ in eng.chat([CONV, CONV], GREEDY):
                    pass
            return toks, text
    toks, text = asyncio.run(run())
    assert toks == want.outputs[0].token_ids and text == want.outputs[0].text


def test_cli_chat_with_piped_stdin(chat_dir, llm, monkeypatch, capsys):
    from hybrid_engine.cli import main
    monkeypatch.setattr(sys, "stdin", io.StringIO("The river ran through\n\n/reset\nOnce upon a time\n"))
    rc = main(["chat", "--model", str(chat_dir), "--device", "cpu", "--dtype", "float32", "--max-tokens", "5",
               "--no-think", "--system", "Be brief."])
    assert rc == 0
    out = capsys.readouterr().out
    p = SamplingParams(max_tokens=5)
    first = llm.chat(CONV, p, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    second = llm.chat([CONV[0], {"role": "user", "content": "Once upon a time"}], p,
                      chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    assert out == first.outputs[0].text + "\n" + second.outputs[0].text + "\n"


def test_cli_help_and_version(capsys):
    from hybrid_engine import __version__
    from hybrid_engine.cli import build_parser
    ap = build_parser()
    with pytest.raises(SystemExit):
        ap.parse_args(["--version"])
    assert capsys.readouterr().out.strip() == f"hybrid-engine {__version__}"
    sub = next(a for a in ap._actions if a.dest == "cmd")
    for name, parser in sub.choices.items():
        for action in parser._actions:
            assert action.help, f"hybrid-engine {name} {action.option_strings} has no help text"
