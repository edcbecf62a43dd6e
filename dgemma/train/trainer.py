"""The training loop: flat and visible. One optimizer step:

    for each micro-batch of this process's share of the global batch:
        loss = block_diffusion_loss(model, batch) / accumulation;  loss.backward()
    clip gradients; AdamW step; warmup + cosine learning rate; log one JSON line

Checkpoints hold the weights (or the LoRA adapter), the optimizer and scheduler, the step and the random
states; they are written to a temporary directory and renamed into place, so a crash never leaves a torn
one. The data position and every sample's noise are functions of the step, so a resumed run computes
exactly the losses the uninterrupted run would have. Under `torchrun`, the model is sharded with FSDP2
(`fully_shard`) and each process takes its slice of the global batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import DiffusionGemmaConfig, TextConfig, preset
from ..model import DiffusionGemma, build
from ..tokenizer import Tokenizer
from ..weights import load, resolve_dtype, save
from .config import TrainConfig
from .data import Example, batch_indices, load_jsonl
from .lora import apply_lora
from .objective import assemble, block_diffusion_loss, draw_sample

EVAL_DRAW_OFFSET = 10**12  # eval samples draw their noise from indices training never reaches


class TrainingDiverged(RuntimeError):
    """The loss or the gradients became NaN or infinite."""


@dataclass
class TrainResult:
    out_dir: Path
    final_dir: Path
    steps: int
    losses: list[float]  # the training loss of each step run in this call
    eval_loss: float | None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _log(*args) -> None:
    if _rank() == 0:
        print(*args, file=sys.stderr, flush=True)


def _build_model(cfg: TrainConfig, device: torch.device) -> tuple[DiffusionGemma, Tokenizer | None]:
    dtype = resolve_dtype(cfg.model.dtype)
    tok_dir = cfg.resolve(cfg.data.tokenizer) or cfg.resolve(cfg.model.path)
    tokenizer = Tokenizer.from_dir(tok_dir) if tok_dir is not None and (tok_dir / "tokenizer.json").is_file() else None
    if cfg.model.path is not None:
        model = load(cfg.resolve(cfg.model.path), dtype=dtype, device=device)
    else:
        config = preset(cfg.model.preset)
        if cfg.model.overrides:
            text = config.text_config.to_dict()
            _check_overrides(cfg.model.overrides, text)
            text.update(cfg.model.overrides)
            text.pop("per_layer_config", None)
            if "num_hidden_layers" in cfg.model.overrides and "layer_types" not in cfg.model.overrides:
                text.pop("layer_types", None)  # the default pattern for the new depth
            source = f"{cfg.model.preset!r} preset with the recipe's model.overrides"
            config = DiffusionGemmaConfig.from_dict({**config.to_dict(), "text_config": text}, source=source)
        if cfg.model.canvas_length is not None:
            config.canvas_length = cfg.model.canvas_length
        model = build(config, device=device, dtype=dtype, seed=cfg.model.init_seed)
    if tokenizer is not None and tokenizer.vocab_size > model.text_config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary only "
            f"{model.text_config.vocab_size}"
        )
    return model, tokenizer


def _check_overrides(overrides: dict, text: dict) -> None:
    """A recipe's model.overrides may only name text_config fields (a misspelt one would be ignored)."""
    known = set(text) | {f.name for f in dataclasses.fields(TextConfig)}  # to_dict folds some fields
    for key in overrides:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else " (see dgemma info --preset NAME for the fields)"
            raise ValueError(f"model.overrides: {key!r} is not a text_config field{hint}")


def _lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _state_dicts(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=opts)


def _save_checkpoint(out_dir: Path, step: int, model, optimizer, scheduler, cfg: TrainConfig, base, tokenizer) -> Path:
    """Write checkpoint-STEP atomically (temp dir + rename) and point `latest` at it."""
    model_state, optim_state = _state_dicts(model, optimizer)
    if _rank() != 0:
        dist.barrier()
        return out_dir / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".checkpoint-{step}."))
    try:
        _save_weights(tmp / "model", model_state, cfg, base, tokenizer)
        torch.save(
            {
                "optimizer": optim_state,
                "scheduler": scheduler.state_dict(),
                "step": step,
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "config": cfg.to_dict(),
            },
            tmp / "trainer_state.pt",
        )
        final = out_dir / f"checkpoint-{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = out_dir / ".latest.tmp"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, out_dir / "latest")
    checkpoints = sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    for old in checkpoints[: -cfg.train.keep_checkpoints]:
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return final


def _save_weights(directory: Path, state: dict, cfg: TrainConfig, base: DiffusionGemma, tokenizer) -> None:
    """A loadable model directory: the full checkpoint, or the adapter (peft format)."""
    if cfg.lora is not None:  # `base` is the PeftModel: its own saver writes the standard adapter files
        base.save_pretrained(str(directory), state_dict=state)
        return
    with torch.device("meta"):
        shell = DiffusionGemma(base.config)
    shell.load_state_dict(state, assign=True)
    shell.generation_config = base.generation_config
    save(shell, directory)
    if tokenizer is not None:
        tokenizer.save(directory)


def _load_checkpoint(path: Path, model, optimizer, scheduler, cfg: TrainConfig) -> int:
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    if cfg.lora is not None:
        weights = load_file(str(path / "model" / "adapter_model.safetensors"))
        current, _ = _state_dicts(model, optimizer)
        model_state = dict(current)
        for key in current:
            if "lora_" in key:
                short = key.replace(".default.weight", ".weight")
                model_state[key] = weights[short]
    else:
        loaded = load(path / "model", dtype=resolve_dtype(cfg.model.dtype))
        model_state = loaded.state_dict()
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    return int(state["step"])


def _optimizer(cfg: TrainConfig, params: list) -> tuple:
    """AdamW over `params` and its schedule (linear warmup, cosine decay; see _lr_factor)."""
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_factor(s, cfg))


def _resume(cfg: TrainConfig, out_dir: Path, model, optimizer, scheduler) -> int:
    """Load the latest checkpoint of out_dir when resuming is on; the step to continue from (0: none)."""
    latest = out_dir / "latest"
    if not (cfg.train.resume and latest.is_file()):
        return 0
    checkpoint_dir = out_dir / latest.read_text().strip()
    start = _load_checkpoint(checkpoint_dir, model, optimizer, scheduler, cfg)
    _log(f"resumed from {checkpoint_dir} at step {start}")
    return start


def _microbatches(indices: list[tuple[int, int]], micro: int) -> list[list[tuple[int, int]]]:
    return [indices[i : i + micro] for i in range(0, len(indices), micro)]


def _batch_loss(model, examples, pairs, cfg, canvas, vocab, eos_id, pad_id, autocast):
    samples = [draw_sample(examples[e], d, cfg.train.seed, canvas, vocab, cfg.objective) for d, e in pairs]
    batch = assemble(samples, canvas, eos_id, pad_id, cfg.objective.encoder_targets)
    with autocast():
        loss, parts = block_diffusion_loss(model, batch, cfg.objective)
    return loss, parts, batch.tokens


@torch.no_grad()
def evaluate(
    model, examples: list[Example], cfg: TrainConfig, canvas: int, vocab: int, eos_id: int, pad_id: int, autocast
) -> float:
    """Mean loss over fixed eval draws (the same noise at every evaluation)."""
    micro = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // _world())
    n = min(len(examples), micro * cfg.train.eval_batches)
    pairs = [(EVAL_DRAW_OFFSET + i, i) for i in range(n)]
    mine = pairs[_rank() :: _world()]
    total, count = torch.zeros(2), 0
    for group in _microbatches(mine, micro):
        loss, _, _ = _batch_loss(model, examples, group, cfg, canvas, vocab, eos_id, pad_id, autocast)
        total += torch.tensor([float(loss) * len(group), len(group)])
        count += len(group)
    if dist.is_initialized():
        dist.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


def train(cfg: TrainConfig, *, progress: bool | None = None, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) the training described by `cfg`; returns where the model went and the losses.

    `stop_after` ends this call after that many steps (a checkpoint is written there), as an interruption
    would; a later call resumes from it.
    """
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = torch.device(cfg.train.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda" and distributed:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    world, rank = _world(), _rank()
    out_dir = cfg.resolve(cfg.train.out_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(cfg.train.seed)
    model, tokenizer = _build_model(cfg, device)
    model.train()
    model.gradient_checkpointing = cfg.train.gradient_checkpointing
    text = model.text_config
    canvas, vocab = model.config.canvas_length, text.vocab_size
    eos_id = text.eos_token_ids[0] if text.eos_token_ids else 1
    pad_id = text.pad_token_id if text.pad_token_id is not None else 0

    max_length = cfg.data.max_length
    train_examples, counts = load_jsonl(
        cfg.resolve(cfg.data.train),
        tokenizer,
        vocab_size=vocab,
        max_length=max_length,
        use_chat_template=cfg.data.chat_template,
    )
    eval_examples = None
    if cfg.data.eval:
        eval_examples, _ = load_jsonl(
            cfg.resolve(cfg.data.eval),
            tokenizer,
            vocab_size=vocab,
            max_length=max_length,
            use_chat_template=cfg.data.chat_template,
        )
    _log(
        f"data: {len(train_examples)} training examples ({counts})"
        + (f", {len(eval_examples)} for evaluation" if eval_examples else "")
    )

    if cfg.train.freeze_router:
        for layer in model.layers:
            if layer.router is not None:
                layer.router.requires_grad_(False)
    base = model
    if cfg.lora is not None:
        base = model = apply_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets)
    if distributed:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        root = model.base_model.model if cfg.lora is not None else model  # the DiffusionGemma itself
        for layer in root.layers:
            fully_shard(layer)
        fully_shard(root)
        # The stack is driven through these methods, not forward(): gather its root parameters around them.
        for method in ("encode", "denoise", "soft_embedding", "lm_head"):
            register_fsdp_forward_method(root, method)

    micro = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // world)
    if cfg.train.batch_size % (micro * world):
        raise ValueError(
            f"train.batch_size ({cfg.train.batch_size}) must be a multiple of micro_batch_size "
            f"({micro}) x processes ({world})"
        )
    accumulation = cfg.train.batch_size // (micro * world)

    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer, scheduler = _optimizer(cfg, params)
    use_bf16 = cfg.train.bf16 if cfg.train.bf16 is not None else device.type == "cuda"

    def autocast():
        if use_bf16:
            return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    start = _resume(cfg, out_dir, model, optimizer, scheduler)
    log_path = out_dir / "log.jsonl"
    if rank == 0:
        _truncate_log(log_path, start)

    show = (progress if progress is not None else sys.stderr.isatty()) and rank == 0
    bar = _ProgressBar(cfg.train.steps, start) if show else None
    losses: list[float] = []
    last_checkpoint = None
    eval_loss = None
    end = cfg.train.steps if stop_after is None else min(cfg.train.steps, start + stop_after)
    for step in range(start, end):
        t0 = time.perf_counter()
        pairs = batch_indices(step, cfg.train.batch_size, len(train_examples), cfg.train.seed)
        mine = pairs[rank * micro * accumulation : (rank + 1) * micro * accumulation]
        totals = torch.zeros(4)  # loss, diffusion loss, encoder loss, tokens
        for group in _microbatches(mine, micro):
            loss, parts, tokens = _batch_loss(
                model, train_examples, group, cfg, canvas, vocab, eos_id, pad_id, autocast
            )
            (loss / accumulation).backward()
            totals += torch.tensor([parts["loss"], parts["diffusion_loss"], parts["encoder_loss"], 0.0]) / accumulation
            totals[3] += tokens
        if dist.is_initialized():
            dist.all_reduce(totals)
            totals[:3] /= world
        grad_norm = torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
        loss_value = float(totals[0])
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            where = f"; the last good checkpoint is {last_checkpoint}" if last_checkpoint else ""
            raise TrainingDiverged(
                f"step {step + 1}: the loss is {loss_value} and the gradient norm {grad_norm}; "
                f"stopping without saving{where} (try a lower optim.lr)"
            )
        lr = scheduler.get_last_lr()[0]  # the rate this step uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss_value)
        seconds = time.perf_counter() - t0
        record = {
            "step": step + 1,
            "loss": loss_value,
            "diffusion_loss": float(totals[1]),
            "encoder_loss": float(totals[2]),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": float(totals[3]) / seconds,
            "seconds": seconds,
        }
        done = step + 1
        if eval_examples and cfg.train.eval_every and done % cfg.train.eval_every == 0:
            model.eval()
            record["eval_loss"] = eval_loss = evaluate(
                model, eval_examples, cfg, canvas, vocab, eos_id, pad_id, autocast
            )
            model.train()
        if rank == 0 and (done % cfg.train.log_every == 0 or done == cfg.train.steps):
            with log_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if bar:
            bar.update(record)
        if done % cfg.train.save_every == 0 or done in (cfg.train.steps, end):
            last_checkpoint = _save_checkpoint(out_dir, done, model, optimizer, scheduler, cfg, base, tokenizer)
    if bar:
        bar.close()
    if end < cfg.train.steps:  # interrupted on purpose: no final evaluation or export yet
        return TrainResult(out_dir, out_dir / "final", end, losses, eval_loss)
    if eval_examples and (not cfg.train.eval_every or cfg.train.steps % cfg.train.eval_every):
        model.eval()
        eval_loss = evaluate(model, eval_examples, cfg, canvas, vocab, eos_id, pad_id, autocast)
        _log(f"eval loss {eval_loss:.4f}")
    final = _export_final(out_dir, cfg, start)
    return TrainResult(out_dir, final, cfg.train.steps, losses, eval_loss)


def _export_final(out_dir: Path, cfg: TrainConfig, start: int) -> Path:
    """out_dir/final: a copy of the last checkpoint's model directory (a checkpoint or an adapter)."""
    final = out_dir / "final"
    if _rank() == 0:
        latest = out_dir / (out_dir / "latest").read_text().strip() / "model"
        tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".final."))
        shutil.rmtree(tmp)
        shutil.copytree(latest, tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    if dist.is_initialized():
        dist.barrier()
    return final


def _truncate_log(path: Path, step: int) -> None:
    """Keep the log lines of steps <= `step` (a resumed run rewrites what follows)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


class _ProgressBar:
    """step / total, loss, tokens/s and ETA on one terminal line (rich)."""

    def __init__(self, total: int, start: int):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            transient=False,
            console=Console(stderr=True),
        )
        self.progress.start()
        self.task = self.progress.add_task("train", total=total, completed=start, info="")

    def update(self, record: dict) -> None:
        info = f"loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s"
        if "eval_loss" in record:
            info += f"  eval {record['eval_loss']:.4f}"
        self.progress.update(self.task, advance=1, info=info)

    def close(self) -> None:
        self.progress.stop()
