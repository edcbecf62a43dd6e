"""`dgemma demo`: a one-minute tour on the models shipped inside dgemma, no download, no GPU.

1. a canvas of random tokens denoised live into Python code from a prompt;
2. infilling: the middle of a small function, written with both sides in view;
3. editing: one span of a function rewritten, everything else kept;
4. a Sudoku solved by the Sudoku model, the grid filling in;
5. a picture described by the small vision-language model: the colour and shape of a scene it has not seen;
then the statistics of each part (denoising steps, tokens per forward, tokens/s), and the code model's
parts against the same model decoding left to right (one forward per token) on the first prompt.

In a terminal the canvases redraw in place (rich); when the output is not a terminal the demo prints
plain text snapshots (no escape codes), so it can be piped or recorded.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..tasks.code import MODEL_DIR as CODE_MODEL_DIR
from ..tasks.shapes import MODEL_DIR as SHAPES_MODEL_DIR

GENERATE_PROMPT = 'def is_prime(n):\n    """Return True if n is a prime number."""\n'
INFILL_PREFIX = "def mean(values):\n    total = "
INFILL_SUFFIX = "\n    return total / len(values)\n"
EDIT_BEFORE, EDIT_SPAN, EDIT_AFTER = "def average(xs):\n    return sum(xs) / ", "len(ys)", "\n"


# Control characters a model writes (ESC above all) would drive the terminal: each is shown as U+FFFD.
_CONTROL = {c: "\ufffd" for c in (*range(32), 127) if chr(c) not in "\n\t"}


def _shown(text: str) -> str:
    """Model text made safe to print: newlines and tabs kept, other control characters replaced."""
    return text.translate(_CONTROL)


@dataclass
class Part:
    name: str
    tokens: int
    steps: int
    forwards: int
    seconds: float


class Screen:
    """Where the demo writes: a rich console; live redraws only on a terminal."""

    def __init__(self, live: bool | None = None, stderr: bool = False):
        from rich.console import Console

        self.console = Console(highlight=False, stderr=stderr)
        self.live = self.console.is_terminal if live is None else live

    def title(self, text: str) -> None:
        if self.live:
            self.console.rule(f"[bold cyan]{text}")
        else:
            self.console.print(f"\n== {text} ==")

    def print(self, *args, **kwargs) -> None:
        self.console.print(*args, **kwargs)


def _stream_view(screen: Screen, render, events, snapshot_steps=(1, 2, 4, 8, 16, 32)):
    """Drive a generation stream; redraw `render(event)` live, or print a few snapshots as plain text."""
    from ..generation.engine import DoneEvent, DraftEvent

    result = None
    if screen.live:
        from rich.live import Live

        with Live(console=screen.console, refresh_per_second=30, transient=False) as live:
            for event in events:
                if isinstance(event, DraftEvent):
                    live.update(render(event))
                elif isinstance(event, DoneEvent):
                    result = event.result
    else:
        for event in events:
            if isinstance(event, DraftEvent) and event.step in snapshot_steps:
                screen.print(f"-- canvas {event.canvas_index + 1}, step {event.step} --")
                screen.print(render(event).plain)
            elif isinstance(event, DoneEvent):
                result = event.result
    return result


def _code_part(screen: Screen, runner, tok, seed: int) -> Part:
    from rich.text import Text

    from ..generation.programs import stream

    screen.title("1. A canvas of random tokens denoised into code")
    screen.print(Text(GENERATE_PROMPT, style="bold"), end="")
    prompt = tok.encode(GENERATE_PROMPT)
    final: list[int] = []

    def render(event) -> Text:
        text = Text(_shown(tok.decode(final)), style="bold")
        for t, ok in zip(event.drafts[0].tolist(), event.accepted[0].tolist(), strict=True):
            text.append(_shown(tok.decode([t])), style="green" if ok else "dim")
        text.append(f"\n[canvas {event.canvas_index + 1}, step {event.step}]", style="cyan")
        return text

    t0 = time.perf_counter()
    result = _stream_view(
        screen, render, stream(runner, prompt, max_new_tokens=2 * runner.model.config.canvas_length, seed=seed)
    )
    seconds = time.perf_counter() - t0
    screen.print(Text(GENERATE_PROMPT, style="bold") + Text(_shown(tok.decode(result.tokens[0]))))
    s = result.stats
    return Part("generate", len(result.tokens[0]), sum(s.steps_per_canvas[0]), s.decoder_forward_passes[0], seconds)


def _warm_up(runner, tok) -> None:
    """One untimed step and one AR token first, so that neither the first part nor the AR row carries the
    one-time costs of a first call (allocations, the BLAS's setup)."""
    from ..ar import generate_ar
    from ..generation.programs import generate

    prompt = tok.encode(GENERATE_PROMPT)
    generate(runner, prompt, max_new_tokens=runner.model.config.canvas_length, max_denoising_steps=1, seed=0)
    generate_ar(runner, prompt, 1, stop_token_ids=[])


def _ar_part(runner, tok, tokens: int) -> Part:
    """The first part's prompt decoded left to right by the same model, one forward per token (dgemma.ar),
    timed the same way: the baseline that the statistics' "vs AR" column divides by."""
    from ..ar import generate_ar

    t0 = time.perf_counter()
    result = generate_ar(runner, tok.encode(GENERATE_PROMPT), tokens, stop_token_ids=[])
    seconds = time.perf_counter() - t0
    n = len(result.tokens[0])
    return Part("AR", n, n, result.stats.decoder_forward_passes[0], seconds)


def _infill_part(screen: Screen, model, tok, seed: int) -> Part:
    from rich.text import Text

    from ..generation.programs import infill

    screen.title("2. Infilling: the middle, with both sides in view")
    screen.print(Text(INFILL_PREFIX) + Text("<fill>", style="reverse") + Text(INFILL_SUFFIX), end="")
    t0 = time.perf_counter()
    r = infill(model, INFILL_PREFIX, INFILL_SUFFIX, tokenizer=tok, seed=seed)
    seconds = time.perf_counter() - t0
    screen.print("->")
    screen.print(Text(INFILL_PREFIX) + Text(_shown(r.middle_text), style="bold green") + Text(INFILL_SUFFIX), end="")
    s = r.result.stats
    row = list(r.scores).index(r.middle_length) if r.scores else 0  # the row of the chosen middle length
    return Part("infill", len(r.middle), s.steps_per_canvas[row][0], s.decoder_forward_passes[row], seconds)


def _edit_part(screen: Screen, model, tok, seed: int) -> Part:
    from rich.text import Text

    from ..generation.programs import edit

    screen.title("3. Editing: one span rewritten, the rest kept")
    before, span, after = (tok.encode(x, add_special_tokens=False) for x in (EDIT_BEFORE, EDIT_SPAN, EDIT_AFTER))
    ids = before + span + after
    screen.print(Text(EDIT_BEFORE) + Text(EDIT_SPAN, style="reverse") + Text(EDIT_AFTER), end="")
    t0 = time.perf_counter()
    r = edit(model, ids, (len(before), len(before) + len(span)), tokenizer=tok, seed=seed)
    seconds = time.perf_counter() - t0
    screen.print("->")
    screen.print(Text(EDIT_BEFORE) + Text(_shown(r.middle_text), style="bold green") + Text(EDIT_AFTER), end="")
    s = r.result.stats
    return Part("edit", len(r.middle), s.steps_per_canvas[0][0], s.decoder_forward_passes[0], seconds)


def _sudoku_part(screen: Screen, model_dir: Path | None, seed: int, quant=None, group_size: int = 64) -> Part:
    import torch

    from ..generation.programs import stream
    from ..tasks import sudoku
    from .tasks import grid_text

    screen.title("4. A Sudoku solved by the Sudoku model")
    model, tok = sudoku.load_model(model_dir, quant, group_size)
    puzzle = sudoku.generate_level("easy", seed).puzzle

    def render(event):
        return grid_text(tok, puzzle, event)

    pins = torch.tensor([[-1 if t is None else t for t in sudoku.template(tok, puzzle)]])
    t0 = time.perf_counter()
    events = stream(model, sudoku.prompt_ids(tok, puzzle), pins=pins, max_new_tokens=81, stop_token_ids=[], seed=seed)
    result = _stream_view(screen, render, events)
    seconds = time.perf_counter() - t0
    grid = sudoku.decode_grid(tok, result.tokens[0])
    left, right = sudoku.pretty(puzzle).splitlines(), sudoku.pretty(grid).splitlines()
    screen.print("puzzle                     the model's grid")
    for a, b in zip(left, right, strict=True):
        screen.print(f"{a:26s} {b}")
    ok = sudoku.is_solution(grid, puzzle)
    screen.print("solved: a valid grid, every clue kept" if ok else "not solved: the grid breaks a rule")
    s = result.stats
    blanks = puzzle.count(sudoku.BLANK)
    return Part("sudoku", blanks, s.steps_per_canvas[0][0], s.decoder_forward_passes[0], seconds)


def _image_part(screen: Screen, seed: int) -> Part:
    """A held-out scene (dgemma/tasks/shapes.py), shown as text, and the model's answer about it."""
    from ..checkpoints.tokenizer import Tokenizer
    from ..checkpoints.weights import load
    from ..runtime.runner import accelerate
    from ..tasks import shapes

    screen.title("5. An image: the small vision-language model names its colour and shape")
    model, tok = load(SHAPES_MODEL_DIR), Tokenizer.from_dir(SHAPES_MODEL_DIR)
    runner = accelerate(model)
    image, shape, colour = shapes.scene(shapes.SPLITS["test"][0] + seed)
    screen.print(f"a held-out picture ({shapes.SIZE}x{shapes.SIZE}): a {colour} {shape}")
    t0 = time.perf_counter()
    tokens = steps = passes = 0
    for kind, truth in (("colour", colour), ("shape", shape)):
        said, result = shapes.ask(runner, tok, image, kind, seed=seed)
        screen.print(f"{shapes.QUESTIONS[kind]} -> {said}" + ("" if said == truth else f" (the picture's is {truth})"))
        s = result.stats
        tokens, steps, passes = (
            tokens + len(result.tokens[0]),
            steps + sum(s.steps_per_canvas[0]),
            passes + s.decoder_forward_passes[0],
        )
    return Part("image", tokens, steps, passes, time.perf_counter() - t0)


def cmd_demo(args: argparse.Namespace) -> int:
    """Run the tour; return 0."""
    import torch

    from ..checkpoints.tokenizer import Tokenizer
    from ..checkpoints.weights import load
    from ..runtime.runner import accelerate

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    screen = Screen(live=False if args.plain else None, stderr=args.json)  # --json: stdout holds the JSON alone
    directory = args.model or CODE_MODEL_DIR
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"no code model in {directory}; train one with recipes/code-small.yaml or give --model")
    model, tok = load(directory, quant=args.quant, group_size=args.group_size), Tokenizer.from_dir(directory)
    runner = accelerate(model)
    screen.print(
        f"dgemma demo: code model {directory.name} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters, canvas {model.config.canvas_length}), on {torch.get_num_threads()} CPU threads"
    )
    _warm_up(runner, tok)
    parts = [
        _code_part(screen, runner, tok, args.seed),
        _infill_part(screen, runner, tok, args.seed),
        _edit_part(screen, runner, tok, args.seed),
    ]
    if not args.no_sudoku:
        parts.append(_sudoku_part(screen, args.sudoku_model, args.seed, args.quant, args.group_size))
    if SHAPES_MODEL_DIR.joinpath("config.json").is_file():
        parts.append(_image_part(screen, args.seed))
    ar = _ar_part(runner, tok, parts[0].tokens or model.config.canvas_length)
    screen.title("Statistics")
    _statistics(screen, parts, ar)
    total = time.perf_counter() - t_start
    screen.print(
        f"total {total:.1f} s; AR: the first prompt decoded left to right by the same code model, one forward "
        "per token; vs AR: tokens/s against it (the code model's parts)"
    )
    if args.json:
        rows = [{**asdict(p), "vs_ar": _vs_ar(p, ar)} for p in parts]
        print(json.dumps({"model": str(directory), "parts": rows, "ar": asdict(ar), "seconds": round(total, 3)}))
    return 0


CODE_PARTS = ("generate", "infill", "edit")  # the parts the code model runs: the ones AR is compared with


def _vs_ar(part: Part, ar: Part) -> float | None:
    """A code-model part's tokens/s over the same model's AR tokens/s (None for the other models' parts)."""
    if part.name not in CODE_PARTS or not ar.tokens:
        return None
    return round((part.tokens / max(part.seconds, 1e-9)) / (ar.tokens / max(ar.seconds, 1e-9)), 3)


def _statistics(screen: Screen, parts: list[Part], ar: Part) -> None:
    """The table: each part's tokens, steps, tokens per forward, tokens/s, seconds and speed against AR."""
    screen.print(
        f"{'part':10s} {'tokens':>7s} {'steps':>6s} {'tok/forward':>12s} {'tok/s':>8s} {'seconds':>8s} {'vs AR':>7s}"
    )
    for p in [*parts, ar]:
        ratio = _vs_ar(p, ar)
        shown = "" if ratio is None else f"{ratio:6.2f}x"
        screen.print(
            f"{p.name:10s} {p.tokens:7d} {p.steps:6d} {p.tokens / max(p.forwards, 1):12.2f} "
            f"{p.tokens / max(p.seconds, 1e-9):8.1f} {p.seconds:8.2f} {shown:>7s}"
        )


def register(sub) -> None:
    s = sub.add_parser(
        "demo",
        help="a one-minute tour on the shipped models (no download, no GPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--model", "-m", type=Path, default=None, help="code model directory (default: the shipped one)")
    s.add_argument("--sudoku-model", type=Path, default=None, help="Sudoku model directory (default: shipped)")
    s.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    s.add_argument("--plain", action="store_true", help="plain text snapshots even in a terminal")
    s.add_argument("--no-sudoku", action="store_true", help="skip the Sudoku part")
    s.add_argument(
        "--json",
        action="store_true",
        help="stdout: one JSON object with each part's tokens, steps, forwards and seconds (the tour goes to stderr)",
    )
    from .common import add_quant_args

    add_quant_args(s)
    s.set_defaults(func=cmd_demo)
