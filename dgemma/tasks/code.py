"""Python code: the corpus, the tokenizer and the training records of dgemma's small code model.

Corpus: the Python standard library's own source (`sysconfig`'s stdlib directory), present on every
machine and under the PSF license. Test suites (`test/`, `tests/`, `idle_test/`, `test_*.py`),
`site-packages` and files that are not UTF-8 or do not parse are left out. Files are taken in sorted
path order and assigned to a split by a hash of their relative path (90 / 5 / 5 %), so no file is in two
splits and the split of a file never depends on which other files exist.

Records (JSONL, already tokenised, see dgemma/train/data.py), mixed half and half:
- continuation: `prompt_ids` = up to `context` tokens of a file, `completion_ids` = the next canvas;
- infilling: `prompt_ids` = the prefix, `completion_ids` = [middle | suffix | end] laid out exactly as
  `dgemma.infill` lays out its canvas, with the suffix and end tokens `pinned` (given, never scored).
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
    from ..testing import make_tokenizer

    return make_tokenizer(vocab_size, corpus=texts)


def _windows(ids: list[int], rng: random.Random, context: int, count: int) -> Iterator[tuple[int, int]]:
    """(start of the prompt, start of the canvas) pairs inside one file."""
    if len(ids) < 2:
        return
    for _ in range(count):
        cut = rng.randrange(1, len(ids))
        yield max(0, cut - context), cut


def records_for_file(
    ids: list[int], rng: random.Random, *, context: int, canvas: int, end_id: int, per_tokens: int = 64
) -> Iterator[dict]:
    """Training records drawn from one tokenised file: about one per `per_tokens` tokens, half of them
    continuations and half infilling canvases."""
    count = max(1, len(ids) // per_tokens)
    for start, cut in _windows(ids, rng, context, count):
        prompt = ids[start:cut]
        if rng.random() < 0.5:
            completion = ids[cut : cut + canvas]
            yield {"prompt_ids": prompt, "completion_ids": completion}
        else:
            middle = rng.randint(1, canvas - 1)
            mid = ids[cut : cut + middle]
            visible = ids[cut + len(mid) : cut + len(mid) + canvas - len(mid)]
            tail = [end_id] * (canvas - len(mid) - len(visible))
            yield {
                "prompt_ids": prompt,
                "completion_ids": mid + visible + tail,
                "pinned": [0] * len(mid) + [1] * (len(visible) + len(tail)),
            }


def write_records(
    files: list[SourceFile], tokenizer, dst: str | Path, *, seed: int, context: int, canvas: int, epochs: int = 1
) -> int:
    """Tokenise `files` and write their records to `dst` (JSONL, atomically); returns the record count."""
    dst = Path(dst)
    tmp = dst.with_suffix(dst.suffix + ".tmp")
    end_id = tokenizer.eos_token_id
    n = 0
    with tmp.open("w") as out:
        for epoch in range(epochs):
            for f in files:
                rng = random.Random(f"{seed}:{epoch}:{f.path}")
                ids = tokenizer.encode(f.text, add_special_tokens=False)
                for record in records_for_file(ids, rng, context=context, canvas=canvas, end_id=end_id):
                    out.write(json.dumps(record) + "\n")
                    n += 1
    tmp.replace(dst)
    return n
