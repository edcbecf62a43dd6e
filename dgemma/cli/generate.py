"""`dgemma generate`, `dgemma chat` and `dgemma infill`: text in, text out, streamed as it becomes final."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..model.config import GenerationConfig
from .answers import add_answer_args, answer_shaped, check_answer_args, read_tools
from .common import (
    add_model_args,
    add_old_name,
    add_sampling_args,
    load_model_and_tokenizer,
    positive_int,
    read_text,
    sampling_overrides,
)

REASONING_HELP = "turn on thinking (the chat template's enable_thinking; the server's `reasoning` field)"


def add_output_args(p: argparse.ArgumentParser) -> None:
    """--show-canvas, --stats and --json for the commands that stream text."""
    p.add_argument("--show-canvas", action="store_true", help="watch each canvas denoise live in the terminal")
    p.add_argument("--stats", action="store_true", help="print timing and steps per canvas to stderr")
    p.add_argument("--json", action="store_true", help="print one JSON object with text and statistics")


def add_reasoning_args(p: argparse.ArgumentParser) -> None:
    """--reasoning (and its old name, --thinking)."""
    p.add_argument("--reasoning", action="store_true", help=REASONING_HELP)
    add_old_name(p, "--thinking", "--reasoning", dest="reasoning", is_flag=True)


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
    from ..generation.engine import DoneEvent, DraftEvent, TokensEvent

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
    """The answer's statistics (--stats, --json); `result` None: nothing was generated (an option chosen)."""
    info = {"finish_reason": "stop"} if result is None else _generation_info(result)
    info.update(extra or {})
    if args.json:
        print(json.dumps({"text": text, **info}))
    else:
        print()
        if args.stats:
            print(" | ".join(f"{k} {v}" for k, v in info.items()), file=sys.stderr)


def _generation_info(result) -> dict:
    s = result.stats
    return {
        "finish_reason": result.finish_reasons[0],
        "tokens": len(result.tokens[0]),
        "canvases": s.canvases,
        "steps_per_canvas": s.steps_per_canvas[0],
        "tokens_per_forward": round(s.tokens_per_forward[0], 3),
        "time_to_first_token_s": None if s.time_to_first_token is None else round(s.time_to_first_token, 4),
        "elapsed_s": round(s.elapsed, 4),
        "tokens_per_second": round(s.tokens_per_second, 2),
    }


def _prompt_ids(tokenizer, text: str, args, config=None, tools=None) -> tuple[list[int], object]:
    """The prompt's token ids, and the Pixels of its --image files (None without): images go before the
    text, in the user's turn (or, with --raw, as image tokens before the text)."""
    from .. import images
    from ..checkpoints.tokenizer import chat_prompt

    pictures = list(getattr(args, "image", None) or [])
    budget = getattr(args, "max_soft_tokens", images.DEFAULT_BUDGET)
    video = _video_part(args)
    if args.raw or not tokenizer.chat_template:
        if tools:
            raise ValueError("--tools are declared by the chat template; leave out --raw")
        if video:
            raise ValueError("--video-frames go through the chat template; leave out --raw")
        if not pictures:
            return tokenizer.encode(text), None
        marker = images.image_token_strings(tokenizer, config)[1]
        return images.text_prompt(tokenizer, config, marker * len(pictures) + text, pictures, budget)
    content = [{"type": "image", "image": p} for p in pictures] + video + [{"type": "text", "text": text}]
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": content if pictures else text}
    ]
    thinking = True if args.reasoning else None
    return chat_prompt(tokenizer, config, messages, budget, enable_thinking=thinking, tools=tools)


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


def _video_part(args) -> list[dict]:
    """--video-frames DIR as a video part: its image files in name order, at --fps."""
    directory = getattr(args, "video_frames", None)
    if directory is None:
        return []
    if not directory.is_dir():
        raise ValueError(f"--video-frames {directory}: not a directory")
    frames = sorted(p for p in directory.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not frames:
        raise ValueError(f"--video-frames {directory}: no image files ({', '.join(IMAGE_SUFFIXES)})")
    return [{"type": "video", "video": frames, "fps": args.fps}]


def add_image_args(p) -> None:
    """--image (repeatable) and --max-soft-tokens."""
    from ..images import DEFAULT_BUDGET, SOFT_TOKEN_BUDGETS

    p.add_argument(
        "--image", action="append", metavar="PATH", help="an image for the prompt (repeatable; placed before the text)"
    )
    p.add_argument(
        "--video-frames",
        type=Path,
        metavar="DIR",
        help="a video as a directory of frames (image files in name order), after the images; each frame "
        "takes up to 70 soft tokens",
    )
    p.add_argument("--fps", type=float, default=1.0, help="frames per second of --video-frames (default 1)")
    p.add_argument(
        "--max-soft-tokens",
        type=int,
        choices=SOFT_TOKEN_BUDGETS,
        default=DEFAULT_BUDGET,
        help=f"the most soft tokens an image may take (default {DEFAULT_BUDGET})",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a reply to one prompt."""
    from ..ar import stream_ar
    from ..checkpoints.tokenizer import check_unicode
    from ..generation.programs import stream

    if args.prompt is None or args.prompt == "-":
        text = read_text("-", "the prompt")
    else:  # argv bytes that are not UTF-8 arrive as lone surrogates
        text = check_unicode(args.prompt, "--prompt")
    if not text.strip():
        raise ValueError("the prompt is empty (give --prompt or text on stdin)")
    if args.ar and (args.image or args.video_frames):
        raise ValueError("--ar decodes text prompts only; leave out --image")
    check_answer_args(args)
    schema = _read_schema(args.json_schema) if args.json_schema else None
    tools = read_tools(args.tools)
    runner, tokenizer = load_model_and_tokenizer(args)
    _check_vision(args, runner.model)
    ids, pixels = _prompt_ids(tokenizer, text, args, runner.model.config, tools)
    shaped = answer_shaped(runner, tokenizer, ids, pixels, args, schema, tools)
    if shaped is not None:
        result, answer, extra = shaped
        if not args.json:
            print(answer, end="")
        report(result, args, answer, extra)
        return 0
    if args.ar:
        limit = args.max_new_tokens or runner.model.generation_config.max_new_tokens
        events = stream_ar(runner, ids, limit, temperature=args.temperature, seed=args.seed)
    else:
        events = stream(runner, ids, pixels=pixels, **sampling_overrides(args))
    printer = TextPrinter(tokenizer)
    result = run_stream(events, tokenizer, args, printer)
    report(result, args, tokenizer.decode(result.tokens[0]))
    return 0


def _read_schema(path: Path) -> dict:
    try:
        schema = json.loads(read_text(str(path), "--json-schema"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--json-schema {path}: not JSON ({e})") from e
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object")
    return schema


def _check_vision(args, model) -> None:
    """--image / --video-frames need a checkpoint with a vision tower."""
    if (args.image or args.video_frames) and model.vision_tower is None:
        raise ValueError(f"{args.model} has no vision tower (config.json has no vision_config): it reads text only")


def cmd_chat(args: argparse.Namespace) -> int:
    """Multi-turn chat in the terminal; the KV cache is reused across turns."""
    from ..generation.session import Session

    runner, tokenizer = load_model_and_tokenizer(args)
    if not tokenizer.chat_template:
        raise ValueError(f"{args.model} has no chat template (chat_template.jinja); use `dgemma generate --raw`")
    from ..checkpoints.tokenizer import chat_prompt

    _check_vision(args, runner.model)
    session = Session(runner, max_length=args.max_context, tokenizer=tokenizer)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    pictures = [{"type": "image", "image": p} for p in args.image or []] + _video_part(args)  # the first turn
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
        first = not any(m["role"] == "user" for m in messages)
        content = [*pictures, {"type": "text", "text": line}] if first and pictures else line
        messages.append({"role": "user", "content": content})
        thinking = True if args.reasoning else None
        ids, pixels = chat_prompt(
            tokenizer, runner.model.config, messages, args.max_soft_tokens, enable_thinking=thinking
        )
        printer = TextPrinter(tokenizer)
        events = session.stream(ids, pixels=pixels, **sampling_overrides(args))
        result = run_stream(events, tokenizer, args, printer)
        reply = tokenizer.decode(result.tokens[0])
        report(result, args, reply)
        messages.append({"role": "assistant", "content": reply})
    return 0


def cmd_infill(args: argparse.Namespace) -> int:
    """Fill the middle between a prefix and a suffix."""
    from ..checkpoints.tokenizer import check_unicode
    from ..generation.programs import infill

    prefix = read_text(args.prefix_file, "--prefix-file") if args.prefix_file else args.prefix
    suffix = read_text(args.suffix_file, "--suffix-file") if args.suffix_file else args.suffix
    if prefix is None or suffix is None:
        raise ValueError("give the prefix (--prefix or --prefix-file) and the suffix (--suffix or --suffix-file)")
    check_unicode(prefix, "--prefix")
    check_unicode(suffix, "--suffix")
    if args.max_new_tokens is not None:
        raise ValueError("the middle's length is set with --middle-length N (or auto), not --max-new-tokens")
    runner, tokenizer = load_model_and_tokenizer(args)
    length = args.middle_length
    middle_length = "auto" if length == "auto" else int(length)
    overrides = sampling_overrides(args)  # a middle is never streamed: the task has no early commit
    result = infill(
        runner, prefix, suffix, middle_length, tokenizer=tokenizer, length_score=args.length_score, **overrides
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
    _register_generate(sub, epilog)
    _register_chat(sub, epilog)
    _register_infill(sub, epilog)


def _register_generate(sub, epilog: str) -> None:
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
    add_image_args(g)
    add_reasoning_args(g)
    add_sampling_args(g)
    g.add_argument("--ar", action="store_true", help="decode autoregressively (token by token) instead")
    g.add_argument("--temperature", type=float, default=0.0, help="with --ar: sampling temperature (0 = greedy)")
    add_answer_args(g)
    add_output_args(g)
    g.set_defaults(func=cmd_generate)


def _register_chat(sub, epilog: str) -> None:
    c = sub.add_parser(
        "chat",
        help="multi-turn chat in the terminal",
        epilog=epilog,
        description="Chat with the model; the conversation's KV cache is reused between turns.",
    )
    add_model_args(c)
    c.add_argument("--system", help="system message")
    add_image_args(c)
    add_reasoning_args(c)
    c.add_argument(
        "--max-context",
        type=positive_int,
        default=None,
        help="positions (every turn's prompt and reply) the conversation may use, which sizes its KV cache "
        "(default 8192)",
    )
    add_old_name(c, "--context", "--max-context", dest="max_context", type=positive_int)
    add_sampling_args(c)
    add_output_args(c)
    c.set_defaults(func=cmd_chat, raw=False)


def _register_infill(sub, epilog: str) -> None:
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
    i.add_argument("--json", action="store_true", help="print one JSON object: middle, text, middle_length, scores")
    i.set_defaults(func=cmd_infill)
