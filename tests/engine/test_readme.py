"""The README's "Use it" snippet runs as written (on the embedded default model, CPU)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_use_it_snippet_runs(tmp_path, monkeypatch, capsys):
    text = README.read_text()
    section = text[text.index("## Use it"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "LLM(model=None" in code
    monkeypatch.setenv("HYBRID_ENGINE_CACHE", str(tmp_path / "cache"))
    exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "steps" in out and ("length" in out or "stop" in out)
