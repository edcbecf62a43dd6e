"""`dgemma quantize --model DIR --out OUT --quant int4` (or `DIR OUT`): write a quantized checkpoint that
loads directly, or (`--format compressed-tensors`) one that vLLM loads, or a GGUF file."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

CALIBRATION_BATCH = 4  # samples a calibration forward pass holds
CALIBRATION_PROMPT = 64  # tokens of each sample run through the encoder; the canvas follows
MAX_CALIBRATION_BYTES = 16 * 2**20  # read at most this much calibration text


def cmd_quantize(args: argparse.Namespace) -> int:
    """Read DIR tensor by tensor, quantizing as it goes, and write OUT (weights, config, tokenizer and
    processor files); with --calibrate, an NVFP4 W4A4 export with calibrated activation scales."""
    from ..checkpoints.vllm_export import check_spec, vllm_path
    from ..checkpoints.weights import load
    from .common import check_out_apart, quant_spec, source_and_out, write_checkpoint

    src, out = source_and_out(args, "DIR", dest="directory")
    if not src.is_dir():
        raise FileNotFoundError(f"model directory {src} does not exist")
    check_out_apart(src, out, "DIR")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise ValueError(f"{out} exists and is not empty; pass --force to write into it")
    if out.is_file() and not args.force:
        raise ValueError(f"{out} exists; pass --force to overwrite it")
    if args.quant is None and args.format != "gguf":
        raise ValueError("give --quant (int8, int4, fp8, nvfp4), or --format gguf with --gguf-type")
    if args.calibrate is not None and (args.format != "compressed-tensors" or args.quant != "nvfp4"):
        raise ValueError("--calibrate writes NVFP4 W4A4: it goes with --format compressed-tensors --quant nvfp4")
    spec = quant_spec(args)
    if args.format == "compressed-tensors":
        check_spec(spec)  # before the long read
    text = _calibration_text(args.calibrate) if args.calibrate is not None else None
    model = load(src, quant=spec, progress=sys.stderr.isatty())
    ranges = _calibrate(model, src, text, args.calibration_samples) if text is not None else None
    written = write_checkpoint(model, out, args, src, input_ranges=ranges)
    before = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    after = sum(f.stat().st_size for f in written)
    kind = (args.gguf_type or "bf16") if args.format == "gguf" else args.quant
    path = vllm_path(spec, w4a4=ranges is not None) if args.format == "compressed-tensors" else None
    if args.json:
        report = {"out": str(out), "quant": kind, "format": args.format, "bytes": after, "source_bytes": before}
        print(json.dumps(report | {"vllm": path, "files": [str(f) for f in written]}))
    else:
        print(f"wrote {out}: {kind} weights ({args.format}), {after / 2**20:.1f} MiB (from {before / 2**20:.1f} MiB)")
        if path:
            print(f"vLLM: {path}; serve it with: vllm serve {out} (docs/quantization.md)")
    return 0


def _calibration_text(path: Path) -> str:
    """The calibration text: a .jsonl file's "text" fields, one sample a line, or a plain text file. At most
    MAX_CALIBRATION_BYTES are read (--calibration-samples takes a few thousand tokens of it); a .jsonl line
    that bound cuts is left out, not read as broken JSON."""
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")
    with path.open("rb") as f:
        raw = f.read(MAX_CALIBRATION_BYTES + 1)
    cut, raw = len(raw) > MAX_CALIBRATION_BYTES, raw[:MAX_CALIBRATION_BYTES]
    if path.suffix != ".jsonl":
        return raw.decode("utf-8", errors="replace")
    return "\n\n".join(_jsonl_texts(path, raw, cut))


def _jsonl_texts(path: Path, raw: bytes, cut: bool) -> list[str]:
    """The "text" of each line of a .jsonl file's bytes: lines end at "\\n" only (not where str.splitlines
    also splits: U+2028, U+2029, U+0085, \\x0b, \\x0c, \\x1c-\\x1e, which a JSON string may hold raw), a
    trailing "\\r" dropped; the last line is left out when the read was `cut` inside it."""
    lines = raw.split(b"\n")
    if cut:
        lines.pop()
        if not lines:
            raise ValueError(f"{path}:1 is longer than {MAX_CALIBRATION_BYTES} bytes; give one sample a line")
    texts = []
    for n, line in enumerate(lines, 1):
        line = line.removesuffix(b"\r")
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError as e:  # UnicodeDecodeError is one too
            raise ValueError(f"{path}:{n} is not JSON: {e}") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f'{path}:{n}: each line of a .jsonl calibration file is {{"text": "..."}}')
        texts.append(row["text"])
    return texts


def _calibrate(model, src: Path, text: str, samples: int) -> dict:
    """Every quantized module's input range on `samples` samples of the calibration text."""
    from ..checkpoints.tokenizer import Tokenizer
    from ..quant.calibrate import calibration_batches, input_amax

    if not (src / "tokenizer.json").is_file():
        raise ValueError(f"--calibrate tokenizes text with the checkpoint's tokenizer, and {src} has no tokenizer.json")
    ids = Tokenizer.from_dir(src).encode(text, add_special_tokens=False)
    batch = min(CALIBRATION_BATCH, samples)
    batches = calibration_batches(
        ids, batch_size=batch, prompt_length=CALIBRATION_PROMPT, canvas_length=model.config.canvas_length,
        batches=-(-samples // batch),
    )  # fmt: skip
    report = (
        (lambda i: print(f"\rcalibrating: batch {i}/{len(batches)}", end="", file=sys.stderr))
        if sys.stderr.isatty()
        else None
    )
    amax = input_amax(model, batches, CALIBRATION_PROMPT, progress=report)
    if report:
        print(file=sys.stderr)
    return amax


def register(sub) -> None:
    from .common import add_format_arg, add_quant_args, add_source_and_out, positive_int

    s = sub.add_parser(
        "quantize",
        help="write a quantized copy of a checkpoint (int8, int4, fp8, nvfp4), for dgemma or vLLM",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Quantize a checkpoint's attention, MLP and expert weights (the router, norms, embeddings, vision "
            "tower and self-conditioning stay in their dtype: see dgemma/quant/__init__.py) and write it as a "
            "checkpoint directory that every dgemma command loads directly, or one vLLM loads, or a GGUF file. "
            "The source is read tensor by tensor, never whole.",
            100,
        )
        + "\n\n"
        "--format compressed-tensors writes, and vLLM runs:\n"
        "  --quant fp8     FP8_DYNAMIC (per channel, activations per token)  -> W8A8Fp8 (FP8 GEMM)\n"
        "  --quant int8    W8A16 per channel                                 -> WNA16 (Marlin)\n"
        "  --quant int4    W4A16, --group-size 32, 64 or 128                 -> WNA16 (Marlin)\n"
        "  --quant nvfp4   NVFP4A16 (weight-only)                            -> W4A16Fp4 (Marlin FP4)\n"
        "  --quant nvfp4 --calibrate TEXT   NVFP4 W4A4, calibrated input scales -> W4A4Fp4 (CUTLASS FP4, "
        "Blackwell)\n\n"
        "The tokenizer, chat template and image processor files are copied beside the weights;\n"
        "docs/quantization.md has the `vllm serve` command of each.",
    )
    add_source_and_out(s, "DIR", "source checkpoint directory", "output directory", dest="directory")
    add_quant_args(s)
    add_format_arg(s)
    s.add_argument(
        "--calibrate",
        type=Path,
        default=None,
        metavar="TEXT",
        help="with --format compressed-tensors --quant nvfp4: calibrate activation scales on this text (a text "
        'file, or .jsonl of {"text": ...}) and write NVFP4 W4A4, which vLLM runs with FP4 activations on Blackwell',
    )
    s.add_argument(
        "--calibration-samples",
        type=positive_int,
        default=16,
        help=f"samples of {CALIBRATION_PROMPT} prompt + one canvas of tokens taken from --calibrate (default 16)",
    )
    s.add_argument("--force", action="store_true", help="write into a non-empty OUT")
    s.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: out, quant, format, bytes, source_bytes, vllm, files",
    )
    s.set_defaults(func=cmd_quantize)
