"""Python code: the corpus, the tokenizer and the training records of dgemma's small code model.

The corpus is this Python's standard library (tests, site-packages and unparsable files left out), split
90/5/5 by a hash of each file's path; records are continuations and infills laid out as `dgemma.infill`
lays out its canvas, a share of them whole syntactic units (`syntax_spans`). docs/code.md has the details.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints.tokenizer import train_bpe

SPLITS = ("train", "validation", "test")
MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "code"  # the shipped model
SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib directory, with '/' separators
    text: str

    @property
    def split(self) -> str:
        return split_of(self.path)


def split_of(path: str) -> str:
    """The split of a file, from a hash of its relative path: 90% train, 5% validation, 5% test."""
    bucket = int.from_bytes(hashlib.sha256(path.encode()).digest()[:4], "big") % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect(root: str | Path | None = None) -> list[SourceFile]:
    """The corpus: every kept `.py` file under `root` (default: this Python's standard library), sorted."""
    root = Path(root) if root is not None else stdlib_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in SKIP_PARTS for part in rel.parts) or rel.name.startswith("test_"):
            continue
        try:
            text = p.read_text(encoding="utf-8")
            ast.parse(text)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
    return files


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE tokenizer (dgemma's specials and chat template) trained on `texts`."""
    return train_bpe(texts, vocab_size)


def _windows(ids: list[int], rng: random.Random, context: int, count: int) -> Iterator[tuple[int, int]]:
    """(start of the prompt, start of the canvas) pairs inside one file."""
    if len(ids) < 2:
        return
    for _ in range(count):
        cut = rng.randrange(1, len(ids))
        yield max(0, cut - context), cut


SPAN_KINDS = ("line", "expression", "body")


def line_starts(text: str) -> list[int]:
    """The character offset at which each line of `text` starts."""
    starts, pos = [], 0
    for line in text.splitlines(keepends=True):
        starts.append(pos)
        pos += len(line)
    return starts


def syntax_spans(text: str, count_tokens: Callable[[str], int], max_tokens: int) -> dict[str, list[tuple[int, int]]]:
    """Character spans (start, end) of a file's whole syntactic units of 1 to `max_tokens` tokens, by kind:
    a `line` (one non-comment line, indentation excluded), an `expression` (an AST expression node within
    one line, not a bare name or constant) and a `body` (a function's body after its docstring).
    These are the spans one infills; the code evaluation cuts them from held-out files."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    starts = line_starts(text)

    def char(lineno: int, col: int) -> int:  # AST columns count UTF-8 bytes
        return starts[lineno - 1] + len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))

    def small(a: int, b: int) -> bool:  # the length test first: it saves tokenising every long line
        return b - a <= 16 * max_tokens and 0 < count_tokens(text[a:b]) <= max_tokens

    found: dict[str, list[tuple[int, int]]] = {k: [] for k in SPAN_KINDS}
    for i, line in enumerate(lines):
        body = line.strip()
        if body and not body.startswith("#"):
            a = starts[i] + len(line) - len(line.lstrip())
            b = starts[i] + len(line.rstrip("\n"))
            if small(a, b):
                found["line"].append((a, b))
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.expr)
            and not isinstance(node, ast.Name | ast.Constant)
            and node.end_lineno == node.lineno
        ):
            a, b = char(node.lineno, node.col_offset), char(node.end_lineno, node.end_col_offset)
            if b - a >= 3 and small(a, b):
                found["expression"].append((a, b))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first, last = node.body[0], node.body[-1]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and len(node.body) > 1:
                first = node.body[1]  # keep the docstring: it says what the body should do
            a = starts[first.lineno - 1] + len(lines[first.lineno - 1]) - len(lines[first.lineno - 1].lstrip())
            b = char(last.end_lineno, last.end_col_offset)
            if small(a, b):
                found["body"].append((a, b))
    return found


@dataclass
class SyntaxSource:
    """What syntactic-span infilling records of one file are cut from: its text, its spans, an encoder."""

    text: str
    spans: dict[str, list[tuple[int, int]]]
    encode: Callable[[str], list[int]]


def _infill_record(prompt: list[int], mid: list[int], after: list[int], canvas: int, end_id: int) -> dict:
    """An infilling record: [middle | suffix (what fits) | end-of-text], all but the middle pinned."""
    visible = after[: canvas - len(mid)]
    tail = [end_id] * (canvas - len(mid) - len(visible))
    return {
        "prompt_ids": prompt,
        "completion_ids": mid + visible + tail,
        "pinned": [0] * len(mid) + [1] * (len(visible) + len(tail)),
    }


def _syntax_record(src: SyntaxSource, rng: random.Random, context: int, canvas: int, end_id: int) -> dict | None:
    kinds = [k for k in SPAN_KINDS if src.spans[k]]
    if not kinds:
        return None
    a, b = rng.choice(src.spans[rng.choice(kinds)])
    # 16 characters per token is more than any stdlib text needs, so the cut-off first token of the
    # prefix and last token of the suffix fall outside the `context` / `canvas` tokens kept
    prompt = src.encode(src.text[max(0, a - 16 * context) : a])[-context:]
    mid = src.encode(src.text[a:b])
    after = src.encode(src.text[b : b + 16 * canvas])
    if not prompt or not 0 < len(mid) < canvas:
        return None
    return _infill_record(prompt, mid, after, canvas, end_id)


def records_for_file(
    ids: list[int],
    rng: random.Random,
    *,
    context: int,
    canvas: int,
    end_id: int,
    per_tokens: int = 64,
    syntax: SyntaxSource | None = None,
    syntax_share: float = 0.0,
) -> Iterator[dict]:
    """Training records drawn from one tokenised file, about one per `per_tokens` tokens: a share
    `syntax_share` of syntactic-span infills (with `syntax`), the rest half continuations and half
    infilling canvases with a random middle."""
    count = max(1, len(ids) // per_tokens)
    for start, cut in _windows(ids, rng, context, count):
        if syntax is not None and rng.random() < syntax_share:
            record = _syntax_record(syntax, rng, context, canvas, end_id)
            if record is not None:
                yield record
            continue
        prompt = ids[start:cut]
        if rng.random() < 0.5:
            yield {"prompt_ids": prompt, "completion_ids": ids[cut : cut + canvas]}
        else:
            middle = rng.randint(1, canvas - 1)
            yield _infill_record(prompt, ids[cut : cut + middle], ids[cut + middle : cut + canvas], canvas, end_id)


def write_records(
    files: list[SourceFile],
    tokenizer,
    dst: str | Path,
    *,
    seed: int,
    context: int,
    canvas: int,
    epochs: int = 1,
    syntax_share: float = 0.0,
) -> int:
    """Tokenise `files` and write their records to `dst` (JSONL, atomically); returns the record count.
    With `syntax_share` > 0, that share of the records infills a whole syntactic unit of at most half a
    canvas (see `records_for_file`)."""
    dst = Path(dst)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    end_id = tokenizer.eos_token_id
    spans: dict[str, dict[str, list[tuple[int, int]]]] = {}  # per file, kept across epochs

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    n = 0
    with tmp.open("w") as out:
        for epoch in range(epochs):
            for f in files:
                rng = random.Random(f"{seed}:{epoch}:{f.path}")
                ids = tokenizer.encode(f.text, add_special_tokens=False)
                syntax = None
                if syntax_share > 0:
                    if f.path not in spans:
                        spans[f.path] = syntax_spans(f.text, lambda s: len(encode(s)), canvas // 2)
                    syntax = SyntaxSource(f.text, spans[f.path], encode)
                records = records_for_file(
                    ids, rng, context=context, canvas=canvas, end_id=end_id, syntax=syntax, syntax_share=syntax_share
                )
                for record in records:
                    out.write(json.dumps(record) + "\n")
                    n += 1
    tmp.replace(dst)
    return n
