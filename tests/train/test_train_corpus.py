"""benchmarks/train corpus and tokenizer: the split is by file and depends only on the path key,
caps and dedup are deterministic, and the BPE tokenizer round-trips code with the project's
special tokens and chat template."""
import os

import pytest

from benchmarks.train.corpus import build_corpus, default_roots, is_heldout
from benchmarks.train.tokenizer import encode_files, train_bpe

CODE = 'def f(x):\n    """Doc."""\n    return {"k": x ** 2}  # Ünïcode ✓\n\n\nclass A(B):\n\tpass\n'


def _tree(root, n, *, seed_text="x"):
    os.makedirs(root / "pkg" / "sub", exist_ok=True)
    for i in range(n):
        ext = (".py", ".md", ".rst", ".txt")[i % 4]
        (root / "pkg" / ("sub" if i % 3 else "") / f"m{i}{ext}").write_text(f"# {seed_text} {i}\n" + CODE * (1 + i % 5))
    (root / "pkg" / "skip.json").write_text("{}")                 # not a corpus extension
    (root / "pkg" / "dup.py").write_text("# x 0\n" + CODE)        # same content as m0.py
    (root / "pkg" / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    os.makedirs(root / "pkg" / "__pycache__", exist_ok=True)
    (root / "pkg" / "__pycache__" / "c.py").write_text(CODE)


def test_split_is_by_path_key_and_deterministic(tmp_path):
    _tree(tmp_path / "a", 120)
    roots = {"purelib": str(tmp_path / "a")}
    c1 = build_corpus(max_bytes=10**7, max_heldout_bytes=10**7, heldout_frac=0.2, roots=roots)
    c2 = build_corpus(max_bytes=10**7, max_heldout_bytes=10**7, heldout_frac=0.2, roots=roots)
    assert [(f.key, f.text) for f in c1.train] == [(f.key, f.text) for f in c2.train]
    assert [f.key for f in c1.heldout] == [f.key for f in c2.heldout]
    train, held = {f.key for f in c1.train}, {f.key for f in c1.heldout}
    assert train and held and not train & held
    assert all(is_heldout(k, 0.2) for k in held) and not any(is_heldout(k, 0.2) for k in train)
    assert 0.05 < len(held) / (len(held) + len(train)) < 0.4
    keys = train | held
    assert not any("__pycache__" in k or k.endswith((".json",)) or k.endswith("bad.py") for k in keys)
    assert c1.duplicates == 1 and len([k for k in keys if k.endswith(("m0.py", "dup.py"))]) == 1
    assert all(os.path.isabs(f.path) and f.key.startswith("purelib/") for f in c1.train + c1.heldout)
    s = c1.summary()
    assert s["train_files"] == len(train) and s["train_bytes"] == sum(len(f.text.encode()) for f in c1.train)

    # more files elsewhere (another machine) never move a file across the split, and a cap keeps
    # the held-out decision of every file it keeps
    _tree(tmp_path / "b", 200, seed_text="y")
    c3 = build_corpus(max_bytes=20_000, max_heldout_bytes=5_000, heldout_frac=0.2,
                      roots={"purelib": str(tmp_path / "a"), "stdlib": str(tmp_path / "b")})
    assert {f.key for f in c3.heldout if f.key.startswith("purelib/")} <= held
    assert {f.key for f in c3.train if f.key.startswith("purelib/")} <= train
    assert s["train_bytes"] > 20_000 >= c3.summary()["train_bytes"] > 15_000
    assert c3.summary()["heldout_bytes"] <= 5_000
    docs = sum(len(f.text.encode()) for f in c3.train if not f.key.endswith(".py"))
    assert docs <= 0.2 * 20_000


def test_bad_corpus_arguments(tmp_path):
    with pytest.raises(ValueError, match="heldout_frac"):
        build_corpus(max_bytes=10, max_heldout_bytes=10, heldout_frac=1.5, roots={})
    with pytest.raises(ValueError, match="max_bytes"):
        build_corpus(max_bytes=0, max_heldout_bytes=10, roots={})


def test_default_roots_are_this_interpreters():
    roots = default_roots()
    assert "stdlib" in roots and os.path.isfile(os.path.join(roots["stdlib"], "os.py"))
    assert len({os.path.realpath(p) for p in roots.values()}) == len(roots)


def test_bpe_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    texts = [CODE * 3, "import os\nfor i in range(10):\n    print(i)\n" * 5, "Some *docs* here.\n" * 4]
    tok = train_bpe(texts, 400)
    assert 259 < len(tok) <= 400
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = encode_files(tok, [CODE])[0]
    assert tok.decode(ids) == CODE and len(ids) < len(CODE.encode())       # merges learnt, lossless
    assert train_bpe(texts, 400).get_vocab() == tok.get_vocab()            # deterministic
    tok.save_pretrained(str(tmp_path))
    back = AutoTokenizer.from_pretrained(str(tmp_path))
    assert back(CODE, add_special_tokens=False)["input_ids"] == ids
    text = back.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                    add_generation_prompt=True, enable_thinking=False)
    assert text == "<|user|>\nhi\n<|assistant|>\n<think></think>"
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(texts, 100)
