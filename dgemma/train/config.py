"""The training configuration (`dgemma train CONFIG.yaml`): typed sections, strictly validated.

    model:      preset: tiny | path: CHECKPOINT_DIR      (exactly one; `overrides` edits a preset)
                quant: int4 | nvfp4 | fp8 | int8          (QLoRA: the frozen base quantized; needs lora)
    data:       train: data.jsonl, eval: ..., tokenizer: DIR, max_length: 1024, chat_template: true
    objective:  eps, self_conditioning_prob, encoder_loss_weight, loss, normalization, ...
    lora:       r: 16, alpha: 32, dropout: 0.0, targets: [attention, mlp, experts], experts: per_expert,
                dtype: fp32
                (omit for full training)
    optim:      lr: 1.5e-4, betas: [0.95, 0.99], weight_decay: 1e-4, warmup_steps: 25, min_lr_ratio: 0.1,
                grad_clip: 1.0
    train:      steps, batch_size, micro_batch_size, seed, out_dir, save_every, eval_every, ...

Defaults follow the published fine-tuning recipes (training-objective.md section 12). Unknown keys, wrong
types and impossible values are errors that name the key.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .objective import ObjectiveConfig

EXPERT_KINDS = ("per_expert", "shared")  # LoRA on the experts: one pair of factors per expert, or one for all


@dataclass
class ModelSection:
    preset: str | None = None  # train from scratch: a named configuration (dgemma.preset)
    path: str | None = None  # fine-tune: a checkpoint directory
    overrides: dict[str, Any] | None = None  # text_config fields changed on top of the preset
    canvas_length: int | None = None  # on top of the preset
    dtype: str = "fp32"  # weights' dtype while training (fp32 recommended on CPU)
    init_seed: int = 0  # random initialisation of a preset
    # a vision tower for a preset (config.json vision_config fields); the image token ids are the
    # tokenizer's <|image>, <|image|>, <image|>, and image tokens attend both ways (as the released model)
    vision: dict[str, Any] | None = None
    # QLoRA: the frozen base held quantized in memory (dgemma.quant's policy: attention, dense MLP, experts),
    # quantized while loading; a checkpoint stored quantized keeps its own format. Needs a lora section.
    quant: str | None = None
    group_size: int = 64  # int4's inputs per scale


@dataclass
class DataSection:
    train: str = ""
    eval: str | None = None
    tokenizer: str | None = None  # a directory with tokenizer.json (default: model.path)
    max_length: int = 1024
    chat_template: bool = True  # render prompt/completion records as a chat when the tokenizer has a template


@dataclass
class LoraSection:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: ["attention", "mlp"])
    experts: str = "per_expert"  # with target "experts": factors per expert, or one pair shared by all
    dtype: str = "fp32"  # the adapters' (and so their gradients' and AdamW states'): fp32 or bf16


@dataclass
class OptimSection:
    lr: float = 1.5e-4
    betas: list[float] = field(default_factory=lambda: [0.95, 0.99])
    eps: float = 1e-8
    weight_decay: float = 1e-4
    warmup_steps: int = 25
    min_lr_ratio: float = 0.1  # cosine decay to this fraction of lr
    grad_clip: float = 1.0


@dataclass
class TrainSection:
    steps: int = 100
    batch_size: int = 8  # global: examples per optimizer step, over all processes
    micro_batch_size: int | None = None  # per process and forward pass (default: batch_size / processes)
    seed: int = 0
    out_dir: str = "runs/train"
    save_every: int = 100
    keep_checkpoints: int = 2
    eval_every: int = 0  # 0: only at the end (when data.eval is set)
    eval_batches: int = 4
    log_every: int = 1
    gradient_checkpointing: bool = False
    bf16: bool | None = None  # autocast to bf16 (default: on CUDA only)
    freeze_router: bool = True
    device: str | None = None  # default: cuda if available, else cpu
    resume: bool = True  # continue from the latest checkpoint in out_dir


@dataclass
class Stage2Section:
    """Stage 2 (dgemma/train/stage2.py): RL with verifiable rewards combined with sampler distillation."""

    reward: str = "sudoku"  # the verifier: sudoku (solved, clues kept) | match (the infill equals the record's)
    prompts_per_step: int = 8
    group_size: int = 4  # canvases sampled per prompt (the GRPO group)
    rl_weight: float = 1.0
    distill_weight: float = 1.0
    clip: float = 0.2
    kl_coef: float = 0.02
    states_per_trajectory: int = 4  # sampler states per rollout used by the distillation loss
    # the distillation target of a rollout: its own final canvas (final) or the teacher's (teacher), kept
    # only when the verifier gives it at least target_threshold; or the record's own completion for every
    # rollout, solved or not (reference: right where the task has one answer, as Sudoku does)
    distill_target: str = "final"
    sampling: dict[str, Any] = field(default_factory=dict)  # the student's sampler (SamplingParams fields)
    teacher_sampling: dict[str, Any] = field(
        default_factory=lambda: {"sampler": "fixed", "tokens_per_step": 2, "max_denoising_steps": 64}
    )
    target_threshold: float = 1.0
    eval_prompts: int = 64  # evaluation rollouts (on data.eval) at train.eval_every and at the end


@dataclass
class TrainConfig:
    model: ModelSection
    data: DataSection
    train: TrainSection
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    lora: LoraSection | None = None
    optim: OptimSection = field(default_factory=OptimSection)
    stage2: Stage2Section | None = None
    base_dir: Path = field(default=Path("."), repr=False)  # paths in the file are relative to it

    def __post_init__(self) -> None:
        errors = []
        if (self.model.preset is None) == (self.model.path is None):
            errors.append("model: give exactly one of 'preset' (train from scratch) or 'path' (fine-tune)")
        if not self.data.train:
            errors.append("data.train is required")
        if self.model.dtype not in ("fp32", "bf16", "fp16"):
            errors.append(f"model.dtype must be fp32, bf16 or fp16 (got {self.model.dtype!r})")
        for name in ("steps", "batch_size", "save_every", "log_every", "eval_batches", "keep_checkpoints"):
            if getattr(self.train, name) <= 0:
                errors.append(f"train.{name} must be > 0")
        if self.train.micro_batch_size is not None and self.train.micro_batch_size <= 0:
            errors.append("train.micro_batch_size must be > 0")
        if self.train.eval_every < 0:
            errors.append("train.eval_every must be >= 0")
        if self.data.max_length <= 1:
            errors.append("data.max_length must be > 1")
        if self.optim.lr <= 0 or self.optim.grad_clip <= 0 or not 0 <= self.optim.min_lr_ratio <= 1:
            errors.append("optim: lr and grad_clip must be > 0, min_lr_ratio in [0, 1]")
        if len(self.optim.betas) != 2 or not all(0 <= b < 1 for b in self.optim.betas):
            errors.append("optim.betas must be two numbers in [0, 1)")
        if self.stage2 is not None:
            s2 = self.stage2
            from .rl import REWARDS

            if s2.reward not in REWARDS:
                errors.append(f"stage2.reward must be one of {sorted(REWARDS)} (got {s2.reward!r})")
            for name in ("prompts_per_step", "group_size", "states_per_trajectory", "eval_prompts"):
                if getattr(s2, name) <= 0:
                    errors.append(f"stage2.{name} must be > 0")
            if s2.rl_weight < 0 or s2.distill_weight < 0 or s2.rl_weight + s2.distill_weight == 0:
                errors.append("stage2: rl_weight and distill_weight must be >= 0, not both 0")
            if s2.distill_target not in ("final", "teacher", "reference"):
                errors.append(f"stage2.distill_target must be final, teacher or reference (got {s2.distill_target!r})")
            if s2.rl_weight > 0 and s2.group_size < 2:
                errors.append("stage2.group_size must be >= 2 for RL (advantages compare a group's members)")
            if self.lora is not None:
                errors.append("stage2 trains full models (no lora section)")
        if self.model.quant is not None:
            from ..quant import MODES

            if self.model.quant not in MODES:
                errors.append(f"model.quant must be one of {MODES} (got {self.model.quant!r})")
            if self.lora is None:
                errors.append("model.quant freezes the base quantized: it needs a lora section (QLoRA)")
        if self.lora is not None and self.lora.experts not in EXPERT_KINDS:
            errors.append(f"lora.experts must be per_expert or shared (got {self.lora.experts!r})")
        if self.lora is not None and self.lora.dtype not in ("fp32", "bf16"):
            errors.append(f"lora.dtype must be fp32 or bf16 (got {self.lora.dtype!r})")
        if errors:
            raise ValueError("invalid training config: " + "; ".join(errors))

    def resolve(self, path: str | None) -> Path | None:
        """A path from the file, relative to the file's directory."""
        if path is None:
            return None
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.base_dir / p

    @classmethod
    def from_dict(cls, d: dict[str, Any], base_dir: Path = Path(".")) -> TrainConfig:
        if not isinstance(d, dict):
            raise ValueError("the training config must be a mapping of sections")
        for required in ("model", "data", "train"):
            if required not in d:
                raise ValueError(f"the training config needs a '{required}' section")
        # An optional section given as null (as to_dict writes it) is absent, not a section of defaults.
        optional = ("lora", "stage2")
        kwargs = {
            name: _build(section_type, d[name], name)
            for name, section_type in _SECTIONS.items()
            if name in d and not (name in optional and d[name] is None)
        }
        unknown = sorted(set(d) - set(_SECTIONS))
        if unknown:
            raise ValueError(f"unknown section(s) {unknown}; the sections are {sorted(_SECTIONS)}")
        return cls(**kwargs, base_dir=base_dir)

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainConfig:
        import yaml

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"training config {path} not found")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {e}") from e
        return cls.from_dict(data or {}, base_dir=path.parent)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for name in _SECTIONS:
            value = getattr(self, name)
            out[name] = None if value is None else dataclasses.asdict(value)
        return out


_SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "objective": ObjectiveConfig,
    "lora": LoraSection,
    "optim": OptimSection,
    "stage2": Stage2Section,
}


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(annotation):
            try:
                return _check_type(value, option, where)
            except ValueError as e:
                errors.append(e)
        raise ValueError(f"{where}: {value!r} is not a valid value ({annotation})")
    if annotation is type(None):
        if value is None:
            return None
        raise ValueError(f"{where}: expected nothing")
    if annotation is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list (got {value!r})")
        (item,) = typing.get_args(annotation)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping (got {value!r})")
        return value
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is bool and not isinstance(value, bool):
        raise ValueError(f"{where}: expected true or false (got {value!r})")
    if annotation is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}: expected an integer (got {value!r})")
    if annotation in (str, float) and not isinstance(value, annotation):
        raise ValueError(f"{where}: expected a {annotation.__name__} (got {value!r})")
    return value


def _build(cls, values: Any, section: str):
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ValueError(f"section '{section}' must be a mapping (got {values!r})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "base_dir"]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown key(s) in '{section}': {unknown}; allowed: {names}")
    checked = {k: _check_type(v, hints[k], f"{section}.{k}") for k, v in values.items()}
    return cls(**checked)
