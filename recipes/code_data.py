"""Build the code model's data: the Python standard library split by file, a BPE tokenizer trained on the
training split, and tokenised training records (continuation and infilling, see dgemma/tasks/code.py).

    python recipes/code_data.py [--vocab 4096] [--canvas 64] [--context 192] [--out recipes/data/code]

Writes tokenizer/ (tokenizer.json + config + chat template), {train,validation,test}.jsonl (the source
files: path and text), {train,validation}-records.jsonl, {train,validation}-syntax-records.jsonl (the
second training stage: half of the records infill a whole line, expression or function body, with a
shorter --syntax-context) and manifest.json (Python version, file counts, tokens, a hash of the file
list). Deterministic for a given Python version and --seed; a few minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from pathlib import Path

from dgemma.tasks import code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stdlib", type=Path, default=None, help="source directory (default: this Python's stdlib)")
    parser.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    parser.add_argument("--canvas", type=int, default=64, help="canvas length of the model (default 64)")
    parser.add_argument("--context", type=int, default=192, help="prompt tokens before a canvas (default 192)")
    parser.add_argument("--epochs", type=int, default=4, help="passes of record drawing over the train files")
    parser.add_argument(
        "--syntax-context", type=int, default=128, help="prompt tokens of the syntax records (default 128)"
    )
    parser.add_argument(
        "--syntax-share", type=float, default=0.5, help="share of syntactic-span infills in them (default 0.5)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "code")
    args = parser.parse_args()
    start = time.time()
    files = code.collect(args.stdlib)
    args.out.mkdir(parents=True, exist_ok=True)
    by_split = {s: [f for f in files if f.split == s] for s in code.SPLITS}
    for split, group in by_split.items():
        with (args.out / f"{split}.jsonl").open("w") as out:
            for f in group:
                out.write(json.dumps({"path": f.path, "text": f.text}) + "\n")
    tokenizer = code.train_tokenizer([f.text for f in by_split["train"]], args.vocab)
    tokenizer.save(args.out / "tokenizer")
    # (name, options): stage 1's records, then stage 2's (syntactic-span infills, shorter prompts, one pass)
    record_sets = [
        ("", {"context": args.context}),
        ("-syntax", {"context": args.syntax_context, "syntax_share": args.syntax_share, "epochs": 1}),
    ]
    counts = {}
    for split, epochs in (("train", args.epochs), ("validation", 1)):
        for name, options in record_sets:
            counts[f"{split}{name}"] = code.write_records(
                by_split[split],
                tokenizer,
                args.out / f"{split}{name}-records.jsonl",
                seed=args.seed,
                canvas=args.canvas,
                **{"epochs": epochs, **options},
            )
    manifest = {
        "python": platform.python_version(),
        "files": {s: len(g) for s, g in by_split.items()},
        "tokens": {
            s: sum(len(tokenizer.encode(f.text, add_special_tokens=False)) for f in g) for s, g in by_split.items()
        },
        "records": counts,
        "vocab": args.vocab,
        "canvas": args.canvas,
        "context": args.context,
        "syntax_context": args.syntax_context,
        "syntax_share": args.syntax_share,
        "file_list_sha256": hashlib.sha256("\n".join(f.path for f in files).encode()).hexdigest(),
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(json.dumps(manifest), file=sys.stderr)
    print(f"done in {time.time() - start:.0f} s -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
