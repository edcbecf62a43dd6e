"""`dgemma generate`'s answers of a given shape, each the program the library and the server run
(dgemma/generation/programs.py): `--json-schema` (generate_json), `--tools` with `--tool-choice` (tool_call),
`--choices` (choose), with the server's names and the library's `retries`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..generation.choose import ToolCall, choose, tool_call
from ..generation.programs import MAX_RETRIES, generate_json
from ..structured import DEFAULT_RETRIES
from .common import read_text, sampling_overrides


def add_answer_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json-schema",
        type=Path,
        metavar="FILE",
        help="answer with JSON valid against this JSON schema: keys and punctuation pinned, each value "
        "denoised under its type's tokens (docs/structured.md)",
    )
    p.add_argument(
        "--tools",
        type=Path,
        metavar="FILE",
        help="a JSON list of tools (OpenAI's {type: function, function: {name, parameters}}): they are "
        "declared in the prompt, and with --tool-choice the answer is a call of one of them",
    )
    p.add_argument(
        "--tool-choice",
        metavar="auto|required|NAME",
        help="the answer is a call: of the function NAME, or (required) of the one the model scores best; "
        "its arguments valid against its parameters schema; auto: the model's scores choose between a call "
        "and text (the server's tool_choice)",
    )
    p.add_argument(
        "--choices",
        nargs="+",
        metavar="OPTION",
        help="the answer is the option the model scores best as the whole answer (the server's `choices`)",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=DEFAULT_RETRIES,
        help=f"with --json-schema or --tool-choice: fills drawn again when an answer does not validate "
        f"(0-{MAX_RETRIES}, default {DEFAULT_RETRIES})",
    )


def read_tools(path: Path | None) -> list[dict] | None:
    """--tools FILE: a JSON list of tools."""
    if path is None:
        return None
    try:
        tools = json.loads(read_text(str(path), "--tools"))
    except json.JSONDecodeError as e:
        raise ValueError(f"--tools {path}: not JSON ({e})") from e
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"--tools {path}: a non-empty JSON list of tools")
    return tools


def check_answer_args(args: argparse.Namespace) -> None:
    """The shapes exclude each other and --ar; --max-new-tokens bounds a JSON answer or a call's arguments."""
    given = [name for name in ("json_schema", "tool_choice", "choices") if getattr(args, name)]
    if len(given) > 1:
        raise ValueError("give one of --json-schema, --tool-choice and --choices")
    if args.tool_choice and not args.tools:
        raise ValueError("--tool-choice needs --tools")
    if given and args.ar:
        raise ValueError(f"--{given[0].replace('_', '-')} lays the answer out on the canvas; leave out --ar")
    if args.choices and args.max_new_tokens is not None:
        raise ValueError("--choices scores whole options; leave out --max-new-tokens")


def answer_shaped(runner, tokenizer, ids: list[int], pixels, args: argparse.Namespace, schema, tools):
    """Run the shaped answer asked for: its generation (None when nothing was generated: an option chosen,
    a call without arguments), its text and what to report with it (the answer's details); None when none
    was asked."""
    kw = dict(tokenizer=tokenizer, **sampling_overrides(args))
    if schema is not None:
        out = generate_json(runner, ids, schema, retries=args.retries, pixels=pixels, **kw)
        extra = {"json": out.value, "attempts": out.attempts, "steps": out.steps}
    elif args.tool_choice:
        name = None if args.tool_choice == "required" else args.tool_choice
        out = tool_call(runner, ids, tools, name=name, retries=args.retries, pixels=pixels, **kw)
        call = out if isinstance(out, ToolCall) else None  # auto: the model may answer with text
        extra = {"tool_call": call and {"name": call.name, "arguments": call.arguments}, "scores": call and call.scores}
    elif args.choices:
        out, extra = choose(runner, ids, list(args.choices), tokenizer=tokenizer), {}
    else:
        return None
    answer = out.answer()
    text = answer.text if answer.text is not None else tokenizer.decode(answer.tokens)
    return answer.generation, text, {**answer.details, **extra}
