"""`dgemma train` and `dgemma merge`."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def cmd_train(args: argparse.Namespace) -> int:
    """Train (or resume training) as a YAML config describes."""
    from ..train.config import TrainConfig
    from ..train.trainer import TrainingDiverged, train

    cfg = TrainConfig.from_yaml(args.config)
    if args.steps is not None:
        cfg.train.steps = args.steps
    if args.out_dir is not None:
        cfg.train.out_dir = str(Path(args.out_dir).resolve())
    if args.no_resume:
        cfg.train.resume = False
    try:
        if cfg.stage2 is not None:
            from ..train.stage2 import train_stage2

            result = train_stage2(cfg)
        else:
            result = train(cfg)
    except TrainingDiverged as e:
        print(f"dgemma train: {e}", file=sys.stderr)
        return 3
    if int(os.environ.get("RANK", "0")) == 0:
        print(
            f"trained {result.steps} steps; model: {result.final_dir}"
            + (f"; eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""),
            file=sys.stderr,
        )
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    """Merge a LoRA adapter into its base checkpoint and write a standalone checkpoint."""
    from ..checkpoints.weights import load
    from ..train.lora import load_adapter
    from .common import options_or_positionals, quant_spec, write_checkpoint

    flags = {"--model": args.model_option, "--adapter": args.adapter_option, "--out": args.out_option}
    base, adapter, out = options_or_positionals(flags, [args.base, args.adapter, args.out])
    if out is None:
        raise ValueError("merge needs the base checkpoint, the adapter and where to write: --model, --adapter, --out")
    # With --quant the base is quantized as it loads and each delta is added to the dequantized weight,
    # which is quantized again: what a QLoRA adapter was trained against, and the bf16 model is never in
    # memory. A base stored quantized merges into its own format the same way.
    model = load(base, dtype=args.dtype, quant=quant_spec(args))
    merged = load_adapter(model, adapter, merge=True)
    write_checkpoint(merged, out, args, base)
    print(f"merged {adapter} into {base}: {out}", file=sys.stderr)
    return 0


def register(sub) -> None:
    t = sub.add_parser(
        "train",
        help="train or fine-tune (full or LoRA) from a YAML config",
        description="Train a DiffusionGemma model with the block-diffusion objective, as CONFIG "
        "describes (see dgemma/train/config.py and the recipes/ folder for the schema). Runs resume "
        "from the latest checkpoint in the output directory. Multi-GPU: "
        "torchrun --nproc_per_node N -m dgemma.cli train CONFIG.",
    )
    t.add_argument("config", type=Path, help="the YAML config")
    t.add_argument("--steps", type=int, default=None, help="override train.steps")
    t.add_argument("--out-dir", default=None, help="override train.out_dir")
    t.add_argument("--no-resume", action="store_true", help="start over even if out_dir has a checkpoint")
    t.set_defaults(func=cmd_train)

    m = sub.add_parser(
        "merge",
        help="merge a LoRA adapter into its base checkpoint",
        description="Add a LoRA adapter's deltas to its base weights and write a checkpoint that "
        "loads without the adapter (tokenizer files are copied along). Without --quant the deltas go "
        "into the full-precision weights; with --quant the base is quantized as it loads and each delta "
        "is added to the dequantized weight, which is quantized again (what a QLoRA adapter was trained "
        "against; the full-precision model is never in memory). A base stored quantized merges into its "
        "own format. --format compressed-tensors writes the result as vLLM serves it.",
    )
    m.add_argument("--model", "-m", dest="model_option", type=Path, default=None, help="the base checkpoint directory")
    m.add_argument(
        "--adapter",
        dest="adapter_option",
        type=Path,
        default=None,
        help="the adapter directory (adapter_config.json, adapter_model.safetensors)",
    )
    m.add_argument("--out", dest="out_option", type=Path, default=None, help="where to write the merged checkpoint")
    m.add_argument("base", nargs="?", type=Path, metavar="BASE", help="the same as --model BASE")
    m.add_argument("adapter", nargs="?", type=Path, metavar="ADAPTER", help="the same as --adapter ADAPTER")
    m.add_argument("out", nargs="?", type=Path, metavar="OUT", help="the same as --out OUT")
    m.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    from .common import add_format_arg, add_quant_args

    add_quant_args(m)
    add_format_arg(m)
    m.set_defaults(func=cmd_merge)
