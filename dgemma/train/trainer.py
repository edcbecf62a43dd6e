"""The training loop, shared by both stages, and stage 1 (block diffusion) on top of it.

A stage hands `loop` its step as a function; the loop clips, steps AdamW, evaluates, logs and checkpoints,
and resumes exactly (the data and noise are functions of the step). Stage 1's step is here (`train`).
Details: docs/training.md, "The training loop".
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import difflib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoints.tokenizer import Tokenizer
from ..checkpoints.weights import load, resolve_dtype
from ..images import GEMMA4_IMAGE_TOKENS, geometry, image_token_strings
from ..model.config import DiffusionGemmaConfig, TextConfig
from ..model.model import DiffusionGemma, build
from ..model.presets import preset
from ..quant import quantize_model
from . import checkpoint, distributed, lora
from .config import TrainConfig
from .data import Example, batch_indices, load_jsonl
from .lora import apply_lora
from .objective import assemble, block_diffusion_loss, draw_sample, fill_token

EVAL_DRAW_OFFSET = 10**12  # eval samples draw their noise from indices training never reaches


class TrainingDiverged(RuntimeError):
    """The loss or the gradients became NaN or infinite."""


@dataclass
class TrainResult:
    """Where a training call left the run."""

    out_dir: Path
    final_dir: Path
    steps: int
    losses: list[float]  # the training loss of each step run in this call
    eval_loss: float | None


@dataclass
class StepResult:
    """What a stage's step function returns, after its backward pass."""

    loss: float  # the step's training loss: checked for NaN, logged as "loss"
    metrics: dict  # logged after "step" and before "lr" (stage 1 puts "loss" here, to log it first)
    tokens: float | None = None  # tokens trained on, for the log's tokens_per_s


@dataclass
class Run:
    """A training run ready for `loop`: the model, its optimizer and where it continues from."""

    cfg: TrainConfig
    model: torch.nn.Module  # what is trained (a peft model under LoRA, possibly sharded)
    tokenizer: Tokenizer | None
    out_dir: Path
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    start: int  # the step to continue from (0: a fresh run)

    @property
    def log_path(self) -> Path:
        return self.out_dir / "log.jsonl"


# -- setup shared by the stages --------------------------------------------------------------------


def prepare(cfg: TrainConfig, *, multi_process: bool = True) -> tuple[DiffusionGemma, Tokenizer | None, torch.device]:
    """The device (and, under torchrun with `multi_process`, the process group), out_dir, the seeded
    model in training mode with its router frozen as configured, and the tokenizer."""
    device = distributed.init(cfg.train.device, multi_process=multi_process)
    if distributed.rank() == 0:
        cfg.resolve(cfg.train.out_dir).mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    model, tokenizer = build_model(cfg, device)
    model.train()
    model.gradient_checkpointing = cfg.train.gradient_checkpointing
    if cfg.train.freeze_router:
        for layer in model.layers:
            if layer.router is not None:
                layer.router.requires_grad_(False)
    return model, tokenizer, device


def _add_vision(config: DiffusionGemmaConfig, vision: dict, tokenizer: Tokenizer | None) -> None:
    """model.vision: a tower on a preset, its image tokens taken from the tokenizer."""
    from ..model.vision import VisionConfig

    if tokenizer is None:
        raise ValueError("model.vision needs a tokenizer with Gemma 4's image tokens (data.tokenizer)")
    ids = [tokenizer.token_to_id(t) for t in GEMMA4_IMAGE_TOKENS]
    if None in ids:
        raise ValueError(f"model.vision: the tokenizer lacks the image tokens {GEMMA4_IMAGE_TOKENS}")
    config.vision_config = {"model_type": "gemma4_vision", **vision}
    VisionConfig.from_dict(config.vision_config, source="the recipe's model.vision")
    config.boi_token_id, config.image_token_id, config.eoi_token_id = ids
    config.text_config.use_bidirectional_attention = "vision"


def build_model(cfg: TrainConfig, device: torch.device) -> tuple[DiffusionGemma, Tokenizer | None]:
    """The model to train (a checkpoint, or a preset with the recipe's overrides) and its tokenizer."""
    dtype = resolve_dtype(cfg.model.dtype)
    tok_dir = cfg.resolve(cfg.data.tokenizer) or cfg.resolve(cfg.model.path)
    tokenizer = Tokenizer.from_dir(tok_dir) if tok_dir is not None and (tok_dir / "tokenizer.json").is_file() else None
    quant = cfg.model.quant
    if cfg.model.path is not None:
        model = load(
            cfg.resolve(cfg.model.path), dtype=dtype, device=device, quant=quant, group_size=cfg.model.group_size
        )
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
        if cfg.model.vision is not None:
            _add_vision(config, cfg.model.vision, tokenizer)
        model = build(config, device=device, dtype=dtype, seed=cfg.model.init_seed)
        if quant is not None:
            quantize_model(model, quant, cfg.model.group_size)
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


def load_data(
    cfg: TrainConfig, tokenizer: Tokenizer | None, model: DiffusionGemma
) -> tuple[list[Example], list[Example] | None, dict[str, int]]:
    """The training examples, the evaluation examples (None without data.eval), and the training file's
    counts of kept, truncated and skipped records. Records may hold images when the model has a tower."""
    image_tokens = None
    if tokenizer is not None and model.vision_tower is not None:
        try:
            image_tokens = image_token_strings(tokenizer, model.config)
        except ValueError:
            image_tokens = None  # records with images are refused, naming their line

    def read(path: str) -> tuple[list[Example], dict[str, int]]:
        return load_jsonl(
            cfg.resolve(path),
            tokenizer,
            vocab_size=model.text_config.vocab_size,
            max_length=cfg.data.max_length,
            use_chat_template=cfg.data.chat_template,
            image_tokens=image_tokens,
            image_geometry=geometry(model.config),
        )

    examples, counts = read(cfg.data.train)
    held_out = read(cfg.data.eval)[0] if cfg.data.eval else None
    return examples, held_out, counts


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(cfg: TrainConfig, params: list) -> tuple:
    """AdamW over `params` and its schedule (linear warmup, cosine decay; see lr_factor)."""
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))


def start_run(cfg: TrainConfig, model: torch.nn.Module, tokenizer: Tokenizer | None) -> Run:
    """AdamW over the model's trainable parameters, resumed from out_dir's latest checkpoint when there
    is one (and resuming is on), with the log cut back to that step."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = make_optimizer(cfg, params)
    out_dir = cfg.resolve(cfg.train.out_dir)
    start = checkpoint.resume(cfg, out_dir, model, optimizer, scheduler)
    run = Run(cfg, model, tokenizer, out_dir, params, optimizer, scheduler, start)
    if distributed.rank() == 0:
        truncate_log(run.log_path, start)
    return run


# -- the loop ---------------------------------------------------------------------------------------


def loop(
    run: Run,
    step_fn: Callable[[int], StepResult],
    *,
    evaluate: Callable[[], dict] | None = None,
    report_final: Callable[[dict], None] | None = None,
    progress: bool | None = None,
    stop_after: int | None = None,
) -> TrainResult:
    """Train `run` from its start step to train.steps, `step_fn(step)` computing each step's gradients.

    `evaluate` (None: no evaluation data) returns metrics: every train.eval_every steps they join that
    step's record, and after the last step (unless it just evaluated) they go to `report_final`. A
    metric named eval_loss becomes the result's. `stop_after` ends this call after that many steps (a
    checkpoint is written there), as an interruption would; a later call resumes from it.
    """
    cfg, t = run.cfg, run.cfg.train
    show = (progress if progress is not None else sys.stderr.isatty()) and distributed.rank() == 0
    bar = ProgressBar(t.steps, run.start) if show else None
    losses: list[float] = []
    last_checkpoint, eval_loss = None, None
    end = t.steps if stop_after is None else min(t.steps, run.start + stop_after)
    try:
        for step in range(run.start, end):
            record = _optimizer_step(run, step_fn, step, last_checkpoint)
            losses.append(record["loss"])
            done = step + 1
            if evaluate and t.eval_every and done % t.eval_every == 0:
                record |= evaluate()
                eval_loss = record.get("eval_loss", eval_loss)
            if distributed.rank() == 0 and (done % t.log_every == 0 or done == t.steps):
                append_log(run.log_path, record)
            if bar:
                bar.update(record)
            if done % t.save_every == 0 or done in (t.steps, end):
                last_checkpoint = checkpoint.save(
                    run.out_dir, done, run.model, run.optimizer, run.scheduler, cfg, run.tokenizer
                )
    finally:
        if bar:
            bar.close()
    if end < t.steps:  # interrupted on purpose: no final evaluation or export yet
        return TrainResult(run.out_dir, run.out_dir / "final", end, losses, eval_loss)
    if evaluate and (not t.eval_every or t.steps % t.eval_every):
        metrics = evaluate()
        eval_loss = metrics.get("eval_loss", eval_loss)
        if report_final:
            report_final(metrics)
    return TrainResult(run.out_dir, checkpoint.export(run.out_dir), t.steps, losses, eval_loss)


def _optimizer_step(run: Run, step_fn: Callable[[int], StepResult], step: int, last_checkpoint) -> dict:
    """One step: the stage's gradients, clipped, then AdamW and the schedule; returns the log record."""
    t0 = time.perf_counter()
    result = step_fn(step)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.params, run.cfg.optim.grad_clip)  # 0 without gradients
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not (math.isfinite(result.loss) and math.isfinite(grad_norm)):
        where = f"; the last good checkpoint is {last_checkpoint}" if last_checkpoint else ""
        raise TrainingDiverged(
            f"step {step + 1}: the loss is {result.loss} and the gradient norm {grad_norm}; "
            f"stopping without saving{where} (try a lower optim.lr)"
        )
    lr = run.scheduler.get_last_lr()[0]  # the rate this step uses
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - t0
    record = {"step": step + 1} | result.metrics
    record["lr"] = lr
    record["loss"] = result.loss  # a key the metrics already hold keeps its place
    record["grad_norm"] = grad_norm
    if result.tokens is not None:
        record["tokens_per_s"] = result.tokens / seconds
    record["seconds"] = seconds
    return record


def append_log(path: Path, record: dict) -> None:
    """One JSON line in the run's log."""
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_log(path: Path, step: int) -> None:
    """Keep the log lines of steps <= `step` (a resumed run rewrites what follows)."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in kept))


class ProgressBar:
    """step / total, loss, tokens/s (when the stage counts tokens) and ETA on one terminal line (rich)."""

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
        info = f"loss {record['loss']:.4f}"
        if "tokens_per_s" in record:
            info += f"  {record['tokens_per_s']:.0f} tok/s"
        if "eval_loss" in record:
            info += f"  eval {record['eval_loss']:.4f}"
        self.progress.update(self.task, advance=1, info=info)

    def close(self) -> None:
        self.progress.stop()


# -- stage 1: block diffusion ----------------------------------------------------------------------


@dataclass
class Batches:
    """Stage 1's data and how a step splits it: micro-batches of block-diffusion samples."""

    cfg: TrainConfig
    train: list[Example]
    eval: list[Example] | None
    canvas: int
    vocab: int
    eos_id: int
    pad_id: int
    micro: int  # examples per forward pass, in each process
    accumulation: int  # micro-batches per optimizer step, in each process
    use_bf16: bool
    device_type: str
    teacher: DiffusionGemma | None = None  # the frozen starting model, for objective.teacher_kl_weight

    def autocast(self):
        if self.use_bf16:
            return torch.autocast(device_type=self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def split(self, pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        return [pairs[i : i + self.micro] for i in range(0, len(pairs), self.micro)]


def _batches(cfg: TrainConfig, model: DiffusionGemma, tokenizer: Tokenizer | None, device: torch.device) -> Batches:
    """Load stage 1's data and check that the global batch divides into micro-batches and processes."""
    text = model.text_config
    examples, held_out, counts = load_data(cfg, tokenizer, model)
    distributed.print0(
        f"data: {len(examples)} training examples ({counts})"
        + (f", {len(held_out)} for evaluation" if held_out else "")
    )
    world = distributed.world_size()
    micro = cfg.train.micro_batch_size or max(1, cfg.train.batch_size // world)
    if cfg.train.batch_size % (micro * world):
        raise ValueError(
            f"train.batch_size ({cfg.train.batch_size}) must be a multiple of micro_batch_size "
            f"({micro}) x processes ({world})"
        )
    return Batches(
        cfg,
        examples,
        held_out,
        canvas=model.config.canvas_length,
        vocab=text.vocab_size,
        eos_id=fill_token(text),
        pad_id=text.pad_token_id if text.pad_token_id is not None else 0,
        micro=micro,
        accumulation=cfg.train.batch_size // (micro * world),
        use_bf16=cfg.train.bf16 if cfg.train.bf16 is not None else device.type == "cuda",
        device_type=device.type,
        teacher=_frozen_copy(model) if cfg.objective.teacher_kl_weight else None,
    )


def _frozen_copy(model: DiffusionGemma) -> DiffusionGemma:
    """The model as training starts, frozen: the autoregressive teacher of an adaptation (its encoder is the
    AR model it was adapted from)."""
    teacher = copy.deepcopy(model).eval()
    teacher.requires_grad_(False)
    return teacher


def _batch_loss(model, b: Batches, examples: list[Example], pairs: list[tuple[int, int]]):
    """The block-diffusion loss of one micro-batch: (loss, its parts, the number of tokens)."""
    cfg = b.cfg
    samples = [draw_sample(examples[e], d, cfg.train.seed, b.canvas, b.vocab, cfg.objective) for d, e in pairs]
    batch = assemble(samples, b.canvas, b.eos_id, b.pad_id, cfg.objective.encoder_targets)
    with b.autocast():
        loss, parts = block_diffusion_loss(model, batch, cfg.objective, b.teacher)
    return loss, parts, batch.tokens


@torch.no_grad()
def evaluate(model, b: Batches) -> float:
    """Mean loss over fixed draws of the evaluation examples (the same noise at every evaluation)."""
    rank, world = distributed.rank(), distributed.world_size()
    n = min(len(b.eval), b.micro * b.cfg.train.eval_batches)
    pairs = [(EVAL_DRAW_OFFSET + i, i) for i in range(n)]
    total = torch.zeros(2)
    for group in b.split(pairs[rank::world]):
        loss, _, _ = _batch_loss(model, b, b.eval, group)
        total += torch.tensor([float(loss) * len(group), len(group)])
    distributed.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


def _diffusion_step(model, b: Batches, step: int) -> StepResult:
    """Stage 1's step: the gradients of this process's share of the step's batch, accumulated over
    micro-batches (the data and every sample's noise are functions of the step)."""
    rank, world, share = distributed.rank(), distributed.world_size(), b.micro * b.accumulation
    pairs = batch_indices(step, b.cfg.train.batch_size, len(b.train), b.cfg.train.seed)
    names = ("loss", "diffusion_loss", "encoder_loss") + (("teacher_kl",) if b.teacher is not None else ())
    totals = torch.zeros(len(names) + 1)  # the losses, then tokens
    for group in b.split(pairs[rank * share : (rank + 1) * share]):
        loss, parts, tokens = _batch_loss(model, b, b.train, group)
        (loss / b.accumulation).backward()
        totals += torch.tensor([parts.get(n, 0.0) for n in names] + [0.0]) / b.accumulation
        totals[-1] += tokens
    distributed.all_reduce(totals)
    totals[:-1] /= world  # the mean loss over processes; tokens stay a sum
    metrics = {n: float(totals[i]) for i, n in enumerate(names)}
    return StepResult(metrics["loss"], metrics, tokens=float(totals[-1]))


def train(cfg: TrainConfig, *, progress: bool | None = None, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) the stage-1 training described by `cfg`; returns where the model went and the
    losses. `stop_after` ends this call after that many steps (see `loop`); a later call resumes."""
    model, tokenizer, device = prepare(cfg)
    b = _batches(cfg, model, tokenizer, device)
    if cfg.lora is not None:
        lo = cfg.lora
        model = apply_lora(model, lo.r, lo.alpha, lo.dropout, lo.targets, lo.experts, resolve_dtype(lo.dtype))
    if distributed.is_launched():
        distributed.shard(lora.base_model(model))
    run = start_run(cfg, model, tokenizer)

    def evaluate_now() -> dict:
        model.eval()
        metrics = {"eval_loss": evaluate(model, b)}
        model.train()
        return metrics

    return loop(
        run,
        lambda step: _diffusion_step(model, b, step),
        evaluate=evaluate_now if b.eval else None,
        report_final=lambda metrics: distributed.print0(f"eval loss {metrics['eval_loss']:.4f}"),
        progress=progress,
        stop_after=stop_after,
    )
