"""The code model's data: the stdlib corpus split by file, the tokenizer round trip, the record layout."""

from __future__ import annotations

import json
import random

from dgemma.generation.editing import infill_template_of
from dgemma.tasks import code


def _fake_stdlib(root):
    files = {
        "a.py": "def f(x):\n    return x + 1\n",
        "pkg/b.py": "import os\n\nclass B:\n    pass\n",
        "pkg/test_b.py": "assert True\n",  # a test module: left out
        "test/c.py": "x = 1\n",  # a test package: left out
        "bad.py": "def broken(:\n",  # does not parse: left out
        "site-packages/d.py": "y = 2\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "latin.py").write_bytes(b"s = '\xe9'\n")  # not UTF-8: left out
    return root


def test_collect_skips_tests_and_broken_files(tmp_path):
    files = code.collect(_fake_stdlib(tmp_path))
    assert [f.path for f in files] == ["a.py", "pkg/b.py"]


def test_stdlib_splits_are_disjoint_and_stable():
    files = code.collect()
    assert len(files) > 300  # the real standard library
    splits = {s: {f.path for f in files if f.split == s} for s in code.SPLITS}
    assert all(splits.values())
    assert not (splits["train"] & splits["validation"] or splits["train"] & splits["test"])
    assert not splits["validation"] & splits["test"]
    assert all(code.split_of(p) == s for s, paths in splits.items() for p in paths)  # a function of the path
    assert 0.8 < len(splits["train"]) / len(files) < 0.97
    assert not any("/test/" in f"/{p}" or p.rsplit("/", 1)[-1].startswith("test_") for p in splits["test"])


def test_tokenizer_round_trip():
    files = code.collect()[:40]
    tok = code.train_tokenizer([f.text for f in files], vocab_size=600)
    for f in files[:10]:
        assert tok.decode(tok.encode(f.text, add_special_tokens=False)) == f.text
    assert tok.eos_token_id is not None and tok.vocab_size <= 600


def test_infill_records_match_the_inference_layout():
    ids = list(range(10, 400))
    rng = random.Random(0)
    canvas, end = 16, 1
    records = list(code.records_for_file(ids, rng, context=32, canvas=canvas, end_id=end, per_tokens=8))
    infills = [r for r in records if "pinned" in r]
    assert infills and len(infills) < len(records)  # both kinds
    for r in records:
        assert (
            len(r["prompt_ids"]) <= 32
            and r["prompt_ids"] == ids[ids.index(r["prompt_ids"][0]) :][: len(r["prompt_ids"])]
        )
        assert len(r["completion_ids"]) <= canvas
    for r in infills:
        middle = r["pinned"].count(0)
        assert r["pinned"] == [0] * middle + [1] * (canvas - middle)
        cut = ids.index(r["prompt_ids"][-1]) + 1
        suffix = ids[cut + middle :]
        template, _ = infill_template_of(middle, suffix, canvas, end)
        assert r["completion_ids"][middle:] == template[middle:]  # what dgemma.infill pins


def test_write_records(tmp_path):
    files = code.collect(_fake_stdlib(tmp_path / "src"))
    tok = code.train_tokenizer([f.text for f in files], vocab_size=300)
    n = code.write_records(files, tok, tmp_path / "r.jsonl", seed=0, context=16, canvas=8)
    lines = (tmp_path / "r.jsonl").read_text().splitlines()
    assert n == len(lines) > 0 and all(json.loads(line)["prompt_ids"] for line in lines)


SOURCE = '''import os


def area(width, height):
    """Rectangle area."""
    return width * height


def shout(name: str) -> str:
    # a comment line is not a span
    text = name.upper() + "!"
    return text


value = area(2, len(os.sep))
'''


def test_syntax_spans_are_whole_units():
    spans = code.syntax_spans(SOURCE, len, max_tokens=40)  # one "token" per character
    texts = {k: {SOURCE[a:b] for a, b in v} for k, v in spans.items()}
    assert "return width * height" in texts["line"] and "# a comment line is not a span" not in texts["line"]
    assert {"width * height", "name.upper()", 'name.upper() + "!"', "len(os.sep)"} <= texts["expression"]
    assert "return width * height" in texts["body"]  # the docstring stays in the prefix
    assert 'text = name.upper() + "!"\n    return text' not in texts["body"]  # 41 characters: over the limit
    for a, b in spans["expression"]:
        compile(SOURCE[a:b], "<span>", "eval")  # a whole expression
    for kind, found in spans.items():
        assert all(0 < b - a <= 40 for a, b in found), kind
    longer = code.syntax_spans(SOURCE, len, max_tokens=60)
    assert 'text = name.upper() + "!"\n    return text' in {SOURCE[a:b] for a, b in longer["body"]}


def test_syntax_records_infill_whole_units_tokenised_apart(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    (root / "m.py").write_text(SOURCE * 3)
    files = code.collect(root)
    tok = code.train_tokenizer([f.text for f in files], vocab_size=300)
    canvas, context = 24, 16
    n = code.write_records(files, tok, tmp_path / "s.jsonl", seed=0, context=context, canvas=canvas, syntax_share=1.0)
    records = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert n == len(records) > 0
    whole = {
        SOURCE[a:b]
        for found in code.syntax_spans(
            SOURCE, lambda s: len(tok.encode(s, add_special_tokens=False)), canvas // 2
        ).values()
        for a, b in found
    }
    for r in records:
        middle = r["pinned"].count(0)
        assert r["pinned"] == [0] * middle + [1] * (canvas - middle) and 0 < middle <= canvas // 2
        mid = r["completion_ids"][:middle]
        assert tok.decode(mid) in whole
        assert mid == tok.encode(tok.decode(mid), add_special_tokens=False)  # tokenised on its own
        assert 0 < len(r["prompt_ids"]) <= context
        # prefix, middle and the visible suffix are consecutive text of the file
        ids = r["prompt_ids"] + r["completion_ids"]
        while ids[-1] == tok.eos_token_id:
            ids = ids[:-1]
        assert tok.decode(ids) in files[0].text
