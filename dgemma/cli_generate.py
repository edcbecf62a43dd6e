"""`dgemma generate`, `dgemma chat` and `dgemma infill`: text in, text out, streamed as it becomes final."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import GenerationConfig

SAMPLING_FLAGS = {
    # flag (generation_config.json name) -> (type, help)
    "max_new_tokens": (int, "tokens to generate at most (returned exactly; default from generation_config.json)"),
    "max_denoising_steps": (int, "denoising steps per canvas at most"),
    "entropy_bound": (float, "entropy-bound sampler: accepted entropy budget per step"),
    "t_min": (float, "temperature at the last denoising step"),
    "t_max": (float, "temperature at the first denoising step"),
    "stability_threshold": (int, "stop a canvas after its argmax is unchanged for this many steps ..."),
    "confidence_threshold": (float, "... and its mean entropy is below this"),
}


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer (got {text})")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        "-m",
        type=Path,
        default=None,
        help="checkpoint directory (config.json, model.safetensors, tokenizer.json); default: the small "
        "code model shipped inside dgemma (trained on the Python standard library)",
    )
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"], help="weight dtype (auto: as stored)"
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--adapter", type=Path, default=None, help="a LoRA adapter directory, merged into the weights")
    add_quant_args(p)


def add_quant_args(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--quant",
        default=None,
        required=required,
        choices=["int8", "int4", "fp8"],
        help="quantize the attention, MLP and expert weights as they load (weight-only; see dgemma.quant)",
    )
    p.add_argument("--group-size", type=positive_int, default=64, help="int4: inputs per scale (default 64)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults: the checkpoint's generation_config.json)")
    for name, (kind, text) in SAMPLING_FLAGS.items():
        g.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=text)
    g.add_argument(
        "--sampler",
        default="entropy-bound",
        choices=["entropy-bound", "confidence", "fixed"],
        help="which positions to accept each step (default: entropy-bound)",
    )
    g.add_argument("--confidence", type=float, default=0.9, help="confidence sampler: accept p(top) >= this")
    g.add_argument("--tokens-per-step", type=positive_int, default=16, help="fixed sampler: tokens added per step")
    g.add_argument(
        "--mode",
        default="fast",
        choices=["fast", "exact"],
        help="fast (default) or exact (same token ids as transformers' generate for the same seed)",
    )
    g.add_argument("--seed", type=int, default=None, help="random seed (reproducible output)")
    g.add_argument(
        "--early-commit",
        action="store_true",
        help="stream a canvas's leading tokens as soon as they settle (and freeze them)",
    )


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--show-canvas", action="store_true", help="watch each canvas denoise live in the terminal")
    p.add_argument("--stats", action="store_true", help="print timing and steps per canvas to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")


def sampling_overrides(args: argparse.Namespace) -> dict:
    out = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    out.update(
        sampler=args.sampler,
        confidence=args.confidence,
        tokens_per_step=args.tokens_per_step,
        mode=args.mode,
        seed=args.seed,
        early_commit=args.early_commit,
    )
    return out


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


def load_model_and_tokenizer(args: argparse.Namespace):

    from .fast import accelerate
    from .tokenizer import Tokenizer
    from .weights import load

    if args.model is None:
        from .tasks.code import MODEL_DIR

        args.model = MODEL_DIR
        print(
            f"dgemma: no --model given, using the shipped code model ({MODEL_DIR}; a small model trained "
            "on the Python standard library, not a chat model)",
            file=sys.stderr,
        )
        if not (MODEL_DIR / "config.json").is_file():
            raise FileNotFoundError(f"the shipped code model is missing from {MODEL_DIR}; reinstall dgemma")
    directory = args.model
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory {directory} does not exist")
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
        from .train.lora import load_adapter

        model = load_adapter(model, args.adapter, merge=True)
    if getattr(args, "mode", "fast") == "fast":  # exact mode keeps the reference forward paths
        accelerate(model, compile=getattr(args, "compile", False))
    if tokenizer.vocab_size > model.text_config.vocab_size:
        raise ValueError(
            f"tokenizer.json has {tokenizer.vocab_size} tokens but the model only {model.text_config.vocab_size}"
        )
    return model, tokenizer


# ------------------------------------------------------------------------------------------------


class TextPrinter:
    """Prints a row's text as tokens become final, decoding the whole so far so multi-token characters
    come out whole."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.tokens: list[int] = []
        self.printed = ""

    def add(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        self._write(text)

    def finish(self) -> None:
        """Print what is left, incomplete characters included (as the replacement character)."""
        self._write(self.tokenizer.decode(self.tokens))

    def _write(self, text: str) -> None:
        # Text never printed ends in an incomplete character, so what was printed stays a prefix.
        self.out.write(text[len(self.printed) :])
        self.out.flush()
        self.printed = text


class CanvasView:
    """A live terminal view of the canvas being denoised (rich): final text, then the current draft, with
    this step's accepted positions bright and the rest dim."""

    def __init__(self, tokenizer):
        from rich.console import Console
        from rich.live import Live

        self.tokenizer = tokenizer
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=30, transient=False)
        self.final: list[int] = []

    def __enter__(self):
        self.live.__enter__()
        return self

    def __exit__(self, *exc):
        self.live.__exit__(*exc)

    def draft(self, event) -> None:
        from rich.text import Text

        text = Text(self.tokenizer.decode(self.final), style="bold")
        for tok, ok in zip(event.drafts[0].tolist(), event.accepted[0].tolist(), strict=True):
            text.append(self.tokenizer.decode([tok]), style="green" if ok else "dim")
        text.append(f"\n[canvas {event.canvas_index + 1}, step {event.step}]", style="cyan")
        self.live.update(text)

    def tokens(self, tokens: list[int]) -> None:
        self.final.extend(tokens)


def run_stream(events, tokenizer, args, printer: TextPrinter):
    """Drive a generation stream: print final text as it comes (or show the canvas); return the result."""
    from .generate import DoneEvent, DraftEvent, TokensEvent

    view = CanvasView(tokenizer) if args.show_canvas else None
    result = None
    if view:
        view.__enter__()
    try:
        for event in events:
            if isinstance(event, DraftEvent) and view:
                view.draft(event)
            elif isinstance(event, TokensEvent) and event.row == 0:
                if view:
                    view.tokens(event.tokens)
                elif not args.json:
                    printer.add(event.tokens)
            elif isinstance(event, DoneEvent):
                result = event.result
    finally:
        if view:
            view.__exit__(None, None, None)
    if not args.json:
        if view:  # the live view showed the text as it formed; the answer itself goes to stdout
            printer.add(result.tokens[0])
        printer.finish()
    return result


def report(result, args, text: str, extra: dict | None = None) -> None:
    s = result.stats
    info = {
        "finish_reason": result.finish_reasons[0],
        "tokens": len(result.tokens[0]),
        "canvases": s.canvases,
        "steps_per_canvas": s.steps_per_canvas[0],
        "tokens_per_forward": round(s.tokens_per_forward[0], 3),
        "time_to_first_token_s": None if s.time_to_first_token is None else round(s.time_to_first_token, 4),
        "elapsed_s": round(s.elapsed, 4),
        "tokens_per_second": round(s.tokens_per_second, 2),
        **(extra or {}),
    }
    if args.json:
        print(json.dumps({"text": text, **info}))
    else:
        print()
        if args.stats:
            print(" | ".join(f"{k} {v}" for k, v in info.items()), file=sys.stderr)


def _prompt_ids(tokenizer, text: str, args) -> list[int]:
    if args.raw or not tokenizer.chat_template:
        return tokenizer.encode(text)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text}
    ]
    return tokenizer.apply_chat_template(messages, enable_thinking=True if args.thinking else None)


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


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a reply to one prompt."""
    from .ar import stream_ar
    from .generate import stream
    from .tokenizer import check_unicode

    if args.prompt is None or args.prompt == "-":
        text = read_text("-", "the prompt")
    else:  # argv bytes that are not UTF-8 arrive as lone surrogates
        text = check_unicode(args.prompt, "--prompt")
    if not text.strip():
        raise ValueError("the prompt is empty (give --prompt or text on stdin)")
    model, tokenizer = load_model_and_tokenizer(args)
    ids = _prompt_ids(tokenizer, text, args)
    if args.ar:
        limit = args.max_new_tokens or model.generation_config.max_new_tokens
        events = stream_ar(model, ids, limit, temperature=args.temperature, seed=args.seed)
    else:
        events = stream(model, ids, **sampling_overrides(args))
    printer = TextPrinter(tokenizer)
    result = run_stream(events, tokenizer, args, printer)
    report(result, args, tokenizer.decode(result.tokens[0]))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Multi-turn chat in the terminal; the KV cache is reused across turns."""
    from .generate import Session

    model, tokenizer = load_model_and_tokenizer(args)
    if not tokenizer.chat_template:
        raise ValueError(f"{args.model} has no chat template (chat_template.jinja); use `dgemma generate --raw`")
    session = Session(model, max_length=args.context, tokenizer=tokenizer)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("dgemma chat: empty line or Ctrl-D to quit, /reset to start over.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        ids = tokenizer.apply_chat_template(messages, enable_thinking=True if args.thinking else None)
        printer = TextPrinter(tokenizer)
        result = run_stream(session.stream(ids, **sampling_overrides(args)), tokenizer, args, printer)
        reply = tokenizer.decode(result.tokens[0])
        report(result, args, reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_infill(args: argparse.Namespace) -> int:
    """Fill the middle between a prefix and a suffix."""
    from .editing import infill
    from .tokenizer import check_unicode

    prefix = read_text(args.prefix_file, "--prefix-file") if args.prefix_file else args.prefix
    suffix = read_text(args.suffix_file, "--suffix-file") if args.suffix_file else args.suffix
    if prefix is None or suffix is None:
        raise ValueError("give the prefix (--prefix or --prefix-file) and the suffix (--suffix or --suffix-file)")
    check_unicode(prefix, "--prefix")
    check_unicode(suffix, "--suffix")
    if args.max_new_tokens is not None:
        raise ValueError("the middle's length is set with --middle-length N (or auto), not --max-new-tokens")
    model, tokenizer = load_model_and_tokenizer(args)
    length = args.middle_length
    middle_length = "auto" if length == "auto" else int(length)
    overrides = sampling_overrides(args)
    overrides.pop("early_commit")
    result = infill(
        model, prefix, suffix, middle_length, tokenizer=tokenizer, length_score=args.length_score, **overrides
    )
    if args.json:
        print(
            json.dumps(
                {
                    "middle": result.middle_text,
                    "text": result.text,
                    "middle_length": result.middle_length,
                    "scores": result.scores,
                }
            )
        )
    else:
        print(result.middle_text if args.middle_only else result.text)
        if args.stats:
            print(f"middle_length {result.middle_length} | scores {result.scores}", file=sys.stderr)
    return 0


def middle_length_arg(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"must be 'auto' or a positive integer (got {text})")
    return text


def register(sub) -> None:
    """Add generate, chat and infill to the `dgemma` subcommands."""
    defaults = GenerationConfig()
    epilog = (
        f"Reference defaults when a checkpoint has no generation_config.json: {defaults.max_denoising_steps} "
        f"steps, entropy bound {defaults.entropy_bound}, temperature {defaults.t_max} -> {defaults.t_min}, "
        f"{defaults.max_new_tokens} new tokens."
    )

    g = sub.add_parser(
        "generate",
        help="generate text from a prompt",
        epilog=epilog,
        description="Generate a reply to a prompt (the chat template is applied when the "
        "checkpoint has one; --raw continues the text instead). Text is printed as it becomes final.",
    )
    add_model_args(g)
    g.add_argument("--prompt", "-p", help="the prompt (default, or '-': read stdin, as UTF-8)")
    g.add_argument("--raw", action="store_true", help="no chat template: continue the prompt text")
    g.add_argument("--system", help="system message (chat template)")
    g.add_argument("--thinking", action="store_true", help="turn on thinking (chat template's enable_thinking)")
    add_sampling_args(g)
    g.add_argument("--ar", action="store_true", help="decode autoregressively (token by token) instead")
    g.add_argument("--temperature", type=float, default=0.0, help="with --ar: sampling temperature (0 = greedy)")
    add_output_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser(
        "chat",
        help="multi-turn chat in the terminal",
        epilog=epilog,
        description="Chat with the model; the conversation's KV cache is reused between turns.",
    )
    add_model_args(c)
    c.add_argument("--system", help="system message")
    c.add_argument("--thinking", action="store_true", help="turn on thinking")
    c.add_argument("--context", type=positive_int, default=None, help="KV cache size in tokens (default 8192)")
    add_sampling_args(c)
    add_output_args(c)
    c.set_defaults(func=cmd_chat, raw=False)

    i = sub.add_parser(
        "infill",
        help="fill the middle between a prefix and a suffix",
        epilog=epilog,
        description="Generate the text between a prefix and a suffix, seeing both. The middle's "
        "length is chosen among 2, 4, 8, ... tokens by the model's own score unless given: by default the "
        "encoder's mean next-token log-probability of the middle and the start of the suffix.",
    )
    add_model_args(i)
    i.add_argument("--prefix", help="text before the gap")
    i.add_argument("--suffix", help="text after the gap")
    i.add_argument("--prefix-file", help="read the prefix from a file (UTF-8; '-': stdin)")
    i.add_argument("--suffix-file", help="read the suffix from a file (UTF-8; '-': stdin)")
    i.add_argument(
        "--middle-length", type=middle_length_arg, default="auto", help="tokens in the middle, or 'auto' (default)"
    )
    i.add_argument(
        "--length-score",
        choices=("encoder", "denoiser"),
        default="encoder",
        help="how --middle-length auto picks: the encoder reading prefix + middle + suffix (default), "
        "or the denoiser's score of each completed canvas",
    )
    i.add_argument("--middle-only", action="store_true", help="print only the middle")
    add_sampling_args(i)
    i.add_argument("--stats", action="store_true", help="print the chosen length and scores to stderr")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.set_defaults(func=cmd_infill)
