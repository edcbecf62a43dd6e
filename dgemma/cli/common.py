"""What the `dgemma` subcommands share: model and sampling flags, model loading, text input, old flag names."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MODEL_HELP = "checkpoint directory (config.json, model.safetensors, tokenizer.json)"


def positive_int(text: str) -> int:
    """An argparse type: an integer > 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text!r})") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


class _OldName(argparse.Action):
    """A flag's name before it was renamed: stores what the new name stores and says the new name on stderr."""

    def __init__(self, option_strings, dest, new: str, nargs=None, const=None, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(
            f"dgemma: note: {option_string} is now {self.new}; the old name goes in a future release", file=sys.stderr
        )
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)


def add_old_name(p, old: str, new: str, dest: str, *, is_flag: bool = False, const=True, type=None) -> None:
    """Accept `old` (hidden from --help) as `new` for one release; `is_flag` for flags without a value
    (storing `const`)."""
    extra = {"nargs": 0, "const": const} if is_flag else {"type": type}
    p.add_argument(old, dest=dest, action=_OldName, new=new, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **extra)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model (default: the shipped code model), --dtype, --device, --adapter, the quantization flags,
    and the forward-pass flags (--kernels, --compile)."""
    p.add_argument(
        "--model",
        "-m",
        type=Path,
        default=None,
        help=f"{MODEL_HELP}; default: the small code model shipped inside dgemma (trained on the Python "
        "standard library)",
    )
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="weight dtype (auto: as stored)"
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--adapter", type=Path, default=None, help="a LoRA adapter directory, merged into the weights")
    add_quant_args(p)
    g = p.add_argument_group("forward passes (dgemma.Runner)")
    g.add_argument(
        "--kernels",
        default="fast",
        choices=["fast", "reference"],
        help="modules that run fast-mode requests: fast (dgemma.runtime.fast: faster norms and experts, CUDA graphs on "
        "CUDA) or reference (model.py's own). Exact-mode requests always run the reference modules (default fast)",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile the fast modules' denoising pass")


def add_model_option(p, help: str = MODEL_HELP) -> None:
    """--model/-m for a command that also takes the model as a positional argument (stored as
    `model_option`; see options_or_positionals)."""
    p.add_argument("--model", "-m", dest="model_option", type=Path, default=None, metavar="DIR", help=help)


def add_source_and_out(p, metavar: str, source_help: str, out_help: str, dest: str = "source") -> None:
    """A command that reads a source and writes OUT: `--model SOURCE --out OUT`, or `SOURCE OUT`, or any
    mix (`source_and_out` reads them back)."""
    add_model_option(p, help=source_help)
    p.add_argument("--out", "-o", type=Path, default=None, metavar="OUT", help=out_help)
    p.add_argument(dest, nargs="?", type=Path, metavar=metavar, help=f"the same as --model {metavar}")
    p.add_argument("out_dir", nargs="?", type=Path, metavar="OUT", help="the same as --out OUT")


def source_and_out(args, metavar: str, dest: str = "source") -> tuple[Path, Path]:
    """(source, OUT) of a command made with `add_source_and_out`; a ValueError when either is missing."""
    source, out = options_or_positionals(
        {"--model": args.model_option, "--out": args.out}, [getattr(args, dest), args.out_dir]
    )
    if source is None or out is None:
        raise ValueError(f"give the source and the output directory: --model {metavar} --out OUT (or {metavar} OUT)")
    return source, out


def check_out_apart(source: Path, out: Path, metavar: str) -> None:
    """Refuse an OUT that would write over the source: OUT the source itself, OUT inside a source directory,
    or the source inside OUT (paths resolved, so links and `..` do not hide it). The source is never
    overwritten, not even with --force."""
    src, dst = source.resolve(), out.resolve()
    if dst == src or (src.is_dir() and dst.is_relative_to(src)) or src.is_relative_to(dst):
        where = "is" if dst == src else "lies inside" if dst.is_relative_to(src) else "holds"
        raise ValueError(f"OUT {out} {where} {metavar} {source}: write elsewhere (the source is never overwritten)")


def options_or_positionals(options: dict, positionals: list) -> list:
    """Each value of `options` (flag -> value) where given, else the next positional argument: a command
    that takes `DIR OUT` also takes `--model DIR --out OUT`, or any mix. A ValueError for a leftover."""
    rest = [v for v in positionals if v is not None]
    values = [value if value is not None else (rest.pop(0) if rest else None) for value in options.values()]
    if rest:
        raise ValueError(
            f"unexpected argument {rest[0]}: {', '.join(options)} are given as flags or as arguments, not both"
        )
    return values


def add_quant_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    """--quant and --group-size."""
    from ..quant.formats import MODES

    p.add_argument(
        "--quant",
        default=None,
        required=required,
        choices=list(MODES),
        help="quantize the attention, MLP and expert weights as they load (weight-only; see dgemma.quant; "
        "nvfp4: FP4 with an fp8 scale per 16 weights, the compressed-tensors NVFP4 format)",
    )
    p.add_argument("--group-size", type=positive_int, default=64, help="int4: inputs per scale (default 64)")


def add_format_arg(p: argparse.ArgumentParser) -> None:
    """--format and --gguf-type: the checkpoint layout a command writes."""
    from ..checkpoints.gguf_file import WRITABLE
    from ..checkpoints.weights import FORMATS

    p.add_argument(
        "--format",
        default="dgemma",
        choices=[*FORMATS, "gguf"],
        help="dgemma: transformers' layout, quantized weights as dgemma stores them (default); "
        "compressed-tensors: what vLLM serves (needs --quant; int4 is then written as W4A16, q * scale); "
        "gguf: llama.cpp's DiffusionGemma layout, one .gguf file (from full-precision weights: --gguf-type)",
    )
    p.add_argument(
        "--gguf-type",
        default=None,
        choices=list(WRITABLE),
        help="--format gguf: the weight matrices' GGUF type (default bf16; norms and the router stay F32)",
    )


def quant_spec(args: argparse.Namespace):
    """The QuantSpec that --quant, --group-size and --format ask for (None: no quantization)."""
    from ..quant import QuantSpec

    fmt = getattr(args, "format", "dgemma")
    if getattr(args, "gguf_type", None) and fmt != "gguf":
        raise ValueError("--gguf-type is for --format gguf")
    if args.quant is None:
        if fmt == "compressed-tensors":
            raise ValueError("--format compressed-tensors writes quantized weights: give --quant")
        return None
    if fmt == "gguf":
        raise ValueError("--format gguf quantizes as it writes: give --gguf-type (q8_0, q4_0, ...), not --quant")
    return QuantSpec.of(args.quant, args.group_size, "symmetric" if fmt == "compressed-tensors" else "mid")


# What travels with a written checkpoint besides its weights and config: the tokenizer, the chat template,
# and the image processor's files (vLLM builds DiffusionGemma's multimodal processor from the model directory)
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
)


def write_checkpoint(model, out: Path, args: argparse.Namespace, source: Path, input_ranges=None) -> list[Path]:
    """Write `model` at `out` in --format, with the tokenizer, chat template and image processor files of
    `source` (SIDE_FILES, beside the weights; inside the .gguf, the tokenizer only); returns the files
    written. `input_ranges`: calibrated activation ranges, for an NVFP4 W4A4 compressed-tensors export."""
    import shutil

    from ..checkpoints.tokenizer import Tokenizer
    from ..checkpoints.weights import save

    if args.format == "gguf":
        from ..checkpoints.gguf_file import write

        kind = args.gguf_type or "bf16"
        path = out if out.suffix == ".gguf" else out / f"{source.name}-{kind}.gguf"
        tokenizer = Tokenizer.from_dir(source) if (source / "tokenizer.json").is_file() else None
        return [write(model, path, kind, tokenizer=tokenizer)]
    save(model, out, format=args.format, input_ranges=input_ranges)
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    return sorted(out.glob("*.safetensors"))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    """A flag for each sampling setting (dgemma.generation.sampling: generation_config.json's names, help, choices)."""
    from ..generation.sampling import CHECKPOINT_DEFAULTED, SETTINGS, SamplingParams

    defaults = SamplingParams()
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    for name, meta in SETTINGS.items():
        flag, default = "--" + name.replace("_", "-"), getattr(defaults, name)
        if meta["kind"] is bool:
            g.add_argument(flag, dest=name, action="store_true", help=meta["help"])
            continue
        text = meta["help"] + ("" if name in CHECKPOINT_DEFAULTED or default is None else f" (default {default})")
        kind = positive_int if meta["kind"] is int and meta["low"] == 1 else meta["kind"]
        g.add_argument(flag, dest=name, type=kind, choices=meta["choices"], default=default, help=text)


def sampling_overrides(args: argparse.Namespace) -> dict:
    """The keyword arguments of dgemma.generate / stream / infill that the sampling flags set."""
    from ..generation.sampling import SETTINGS

    return {name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None}


def resolve_device(name: str | None) -> str:
    """The --device to use (default: cuda when available, else cpu), refused clearly when it cannot be."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name}: not a device name (cpu, cuda, cuda:1, ...)") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: this PyTorch sees no CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    elif device.type not in ("cpu", "mps"):
        raise ValueError(f"--device {name}: dgemma runs on cpu or cuda")
    return name


def _default_model_dir() -> Path:
    from ..tasks.code import MODEL_DIR

    print(
        f"dgemma: no --model given, using the shipped code model ({MODEL_DIR}; a small model trained "
        "on the Python standard library, not a chat model)",
        file=sys.stderr,
    )
    if not (MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the shipped code model is missing from {MODEL_DIR}; reinstall dgemma")
    return MODEL_DIR


def make_runner(model, args: argparse.Namespace, *, graphs: bool | None = None):
    """The Runner that --kernels and --compile ask for (fast modules unless --kernels reference); `graphs`
    as Runner takes it (None: on CUDA when the step can be captured)."""
    from ..runtime.runner import Runner

    if args.kernels == "reference":
        if args.compile:
            raise ValueError("--compile compiles the fast modules; it does not go with --kernels reference")
        return Runner(model)
    return Runner(model, fast=True, compile=args.compile, graphs=graphs)


def load_model_and_tokenizer(args: argparse.Namespace):
    """The Runner (see make_runner) and tokenizer of the model that add_model_args' flags name."""
    model, tokenizer = load_model(args)
    return make_runner(model, args), tokenizer


def load_model(args: argparse.Namespace):
    """The model (reference modules) and tokenizer that add_model_args' flags name."""
    from ..checkpoints.tokenizer import Tokenizer
    from ..checkpoints.weights import load

    if args.model is None:
        args.model = _default_model_dir()
    directory = args.model
    if not directory.is_dir() and not (directory.is_file() and directory.suffix == ".gguf"):
        raise FileNotFoundError(f"model directory (or .gguf file) {directory} does not exist")
    tokenizer = Tokenizer.from_dir(directory)
    device = resolve_device(args.device)
    if args.quant and args.adapter is not None:
        raise ValueError("--adapter merges into full-precision weights; merge first (dgemma merge), then --quant")
    model = load(
        directory,
        dtype=args.dtype,
        device=device,
        progress=sys.stderr.isatty(),
        quant=args.quant,
        group_size=args.group_size,
    )
    if args.adapter is not None:
        from ..train.lora import load_adapter

        model = load_adapter(model, args.adapter, merge=True)
    if tokenizer.vocab_size > model.text_config.vocab_size:
        raise ValueError(
            f"tokenizer.json has {tokenizer.vocab_size} tokens but the model only {model.text_config.vocab_size}"
        )
    return model, tokenizer


def read_text(source: str, what: str) -> str:
    """The UTF-8 text of a file, or of stdin when `source` is "-"; a ValueError naming `what` otherwise."""
    try:
        if source == "-":
            data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        else:
            data = Path(source).read_bytes()
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{what} {source} does not exist") from e
    except OSError as e:
        raise ValueError(f"{what} {source}: {e.strerror or e}") from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = "stdin" if source == "-" else source
        raise ValueError(
            f"{what}: {where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); give UTF-8 text"
        ) from None
