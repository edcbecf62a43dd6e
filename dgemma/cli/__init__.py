"""The `dgemma` command line: one console script with subcommands."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from .. import __version__
from ..model.config import DiffusionGemmaConfig, GenerationConfig
from ..model.presets import PRESETS, preset
from ..model.sizes import count_parameters, human_count
from .common import add_model_option


def _describe(config: DiffusionGemmaConfig) -> dict:
    t = config.text_config
    counts = count_parameters(config)
    layers = t.layers
    n_full = sum(not s.is_sliding for s in layers)
    return {
        "parameters_total": counts["total"],
        "parameters_active": counts["active"],
        "parameters_vision": counts["vision"],  # the vision tower and its projection (in the total)
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "layers": f"{t.num_hidden_layers} ({t.num_hidden_layers - n_full} sliding-window, {n_full} global)",
        "attention_heads": t.num_attention_heads,
        "sliding": f"head_dim {t.head_dim}, {t.num_key_value_heads} KV heads, window {t.sliding_window}",
        "global": f"head_dim {t.global_head_dim}, {layers[-1].num_key_value_heads} KV heads, K = V",
        "feed_forward": f"dense GeGLU {t.intermediate_size}"
        + (
            f" + {t.num_experts} experts (top-{t.top_k_experts}, size {t.moe_intermediate_size})"
            if t.has_experts
            else " (dense only)"
        ),
        "canvas_length": config.canvas_length,
        "final_logit_softcapping": t.final_logit_softcapping,
    }


def cmd_info(args: argparse.Namespace) -> int:
    """Print a model's configuration and parameter counts (computed, nothing is loaded)."""
    if args.preset:
        config = preset(args.preset)
        source = f"preset {args.preset}"
        generation = GenerationConfig()
    else:
        from ..checkpoints.gguf_file import gguf_path, read_config

        directory = args.model_option or args.directory
        source = str(directory)
        gguf = gguf_path(directory)
        if gguf is not None:  # the metadata only: no tensor is read
            config, generation = read_config(gguf)
        else:
            config, generation = DiffusionGemmaConfig.from_file(directory), GenerationConfig.from_file(directory)
    info = _describe(config)
    info["generation_defaults"] = generation.to_dict()
    if args.json:
        print(json.dumps({"source": source, **info}, indent=2))
        return 0
    print(f"DiffusionGemma model: {source}")
    for key, value in info.items():
        if key.startswith("parameters"):
            value = f"{human_count(value)} ({value:,})"
        print(f"  {key.replace('_', ' '):24s} {value}")
    if not args.preset:
        for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
            print(f"  {name:24s} {'present' if (directory / name).is_file() else 'absent'}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dgemma",
        description="dgemma: an independent pure-PyTorch implementation of DiffusionGemma "
        "(block text diffusion on Gemma 4). Not affiliated with Google.",
    )
    parser.add_argument("--version", action="version", version=f"dgemma {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    info = sub.add_parser(
        "info",
        help="show a checkpoint's or preset's architecture and parameter counts",
        description="Show the architecture and parameter counts of a checkpoint directory "
        "(config.json is read; no weights are loaded) or of a named preset.",
    )
    src = info.add_mutually_exclusive_group(required=True)
    add_model_option(src, help="checkpoint directory (holds config.json)")
    src.add_argument("directory", nargs="?", type=Path, metavar="DIR", help="the same as --model DIR")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a named configuration instead of a directory")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    info.set_defaults(func=cmd_info)

    from . import adapt, analyze, bench, demo, generate, quant, serve, tasks, train

    generate.register(sub)
    serve.register(sub)
    train.register(sub)
    tasks.register(sub)
    demo.register(sub)
    quant.register(sub)
    bench.register(sub)
    analyze.register(sub)
    adapt.register(sub)
    return parser


def _show_notice(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"note: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_notice  # one clean line per notice, not the source line behind it
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"dgemma {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
