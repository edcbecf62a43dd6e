"""`dgemma quantize --model DIR --out OUT --quant int4` (or `DIR OUT`): write a quantized checkpoint that
loads directly."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def cmd_quantize(args: argparse.Namespace) -> int:
    """Read DIR tensor by tensor, quantizing as it goes, and write OUT (weights, config, tokenizer)."""
    from .cli_common import options_or_positionals, quant_spec, write_checkpoint
    from .weights import load

    src, out = options_or_positionals({"--model": args.model_option, "--out": args.out}, [args.directory, args.out_dir])
    if src is None or out is None:
        raise ValueError("give the source and the output directory: --model DIR --out OUT (or DIR OUT)")
    if not src.is_dir():
        raise FileNotFoundError(f"model directory {src} does not exist")
    if out.resolve() == src.resolve():
        raise ValueError("OUT must differ from DIR (the source checkpoint is never overwritten)")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ValueError(f"{out} exists and is not empty; pass --force to write into it")
    if out.is_file() and not args.force:
        raise ValueError(f"{out} exists; pass --force to overwrite it")
    if args.quant is None and args.format != "gguf":
        raise ValueError("give --quant (int8, int4, fp8, nvfp4), or --format gguf with --gguf-type")
    spec = quant_spec(args)
    model = load(src, quant=spec, progress=sys.stderr.isatty())
    written = write_checkpoint(model, out, args, src)
    before = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    after = sum(f.stat().st_size for f in written)
    kind = (args.gguf_type or "bf16") if args.format == "gguf" else args.quant
    if args.json:
        report = {"out": str(out), "quant": kind, "format": args.format, "bytes": after, "source_bytes": before}
        print(json.dumps(report | {"files": [str(f) for f in written]}))
    else:
        print(f"wrote {out}: {kind} weights ({args.format}), {after / 2**20:.1f} MiB (from {before / 2**20:.1f} MiB)")
    return 0


def register(sub) -> None:
    from .cli_common import add_format_arg, add_model_option, add_quant_args

    s = sub.add_parser(
        "quantize",
        help="write a quantized copy of a checkpoint (int8, int4, fp8, nvfp4)",
        description="Quantize a checkpoint's attention, MLP and expert weights (weight-only; the router, "
        "norms, embeddings and self-conditioning stay in their dtype: see dgemma/quant/__init__.py) and "
        "write it as a checkpoint directory that every command loads directly, or (--format "
        "compressed-tensors) one vLLM serves. The source is read tensor by tensor, never whole.",
    )
    add_model_option(s, help="source checkpoint directory")
    s.add_argument("--out", "-o", type=Path, default=None, metavar="OUT", help="output directory")
    s.add_argument("directory", nargs="?", type=Path, metavar="DIR", help="the same as --model DIR")
    s.add_argument("out_dir", nargs="?", type=Path, metavar="OUT", help="the same as --out OUT")
    add_quant_args(s)
    add_format_arg(s)
    s.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    s.add_argument("--json", action="store_true", help="print one JSON object: out, quant, format, bytes, source_bytes")
    s.set_defaults(func=cmd_quantize)
