"""Training checkpoints: written atomically, found, resumed from, and exported.

    OUT_DIR/
      checkpoint-STEP/model/        a loadable model directory (or, under LoRA, the adapter in peft's format)
      checkpoint-STEP/trainer_state.pt   optimizer, scheduler, step, random states, the config
      latest                        the name of the newest checkpoint
      final/                        after the last step: a copy of the last checkpoint's model directory

Each checkpoint is written to a temporary directory and renamed into place, and `latest` is replaced
the same way, so a crash never leaves a torn one. Only the newest `train.keep_checkpoints` are kept.
Under torchrun every process takes part in gathering the state; rank 0 writes.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from ..checkpoints.tokenizer import Tokenizer
from ..checkpoints.weights import load as load_model
from ..checkpoints.weights import resolve_dtype, write_notice
from ..checkpoints.weights import save as save_model
from ..model.model import DiffusionGemma
from . import distributed, lora
from .config import TrainConfig


def _state_dicts(model, optimizer):
    """The full (unsharded) model and optimizer state dicts, on the CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=opts)


def save(out_dir: Path, step: int, model, optimizer, scheduler, cfg: TrainConfig, tokenizer: Tokenizer | None) -> Path:
    """Write out_dir/checkpoint-STEP atomically (temp dir + rename), point `latest` at it and drop the
    checkpoints beyond `train.keep_checkpoints`; returns its path."""
    model_state, optim_state = _state_dicts(model, optimizer)
    final = out_dir / f"checkpoint-{step}"
    if distributed.rank() != 0:
        distributed.barrier()
        return final
    tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".checkpoint-{step}."))
    try:
        _save_weights(tmp / "model", model, model_state, cfg, tokenizer)
        trainer_state = {
            "optimizer": optim_state,
            "scheduler": scheduler.state_dict(),
            "step": step,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
            "config": cfg.to_dict(),
        }
        torch.save(trainer_state, tmp / "trainer_state.pt")
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
    distributed.barrier()
    return final


def _save_weights(directory: Path, model, state: dict, cfg: TrainConfig, tokenizer: Tokenizer | None) -> None:
    """A loadable model directory: the full checkpoint (with the tokenizer), or the adapter (peft format);
    either with the starting model's NOTICE (the license that weights trained from it carry)."""
    if cfg.lora is not None:
        lora.save_adapter(model, directory, state)
        write_notice(directory, lora.base_model(model).notice)
        return
    with torch.device("meta"):  # `model` may be sharded: save a shell filled with the gathered state
        shell = DiffusionGemma(model.config)
    shell.load_state_dict(state, assign=True)
    shell.generation_config = model.generation_config
    shell.notice = model.notice
    save_model(shell, directory)
    if tokenizer is not None:
        tokenizer.save(directory)


def load(path: Path, model, optimizer, scheduler, cfg: TrainConfig) -> int:
    """Restore the model (or its adapter), optimizer, scheduler and random states saved in checkpoint
    directory `path`; returns the step it was saved at."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)
    if cfg.lora is not None:  # only the adapters: set_state_dict keeps the (frozen) base weights as they are
        model_state = lora.adapter_state(model, path / "model")
    else:
        model_state = load_model(path / "model", dtype=resolve_dtype(cfg.model.dtype)).state_dict()
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


def latest(out_dir: Path) -> Path | None:
    """The newest checkpoint directory of out_dir (None before the first checkpoint)."""
    pointer = out_dir / "latest"
    return out_dir / pointer.read_text().strip() if pointer.is_file() else None


def resume(cfg: TrainConfig, out_dir: Path, model, optimizer, scheduler) -> int:
    """Load the latest checkpoint of out_dir when `train.resume` is on; the step to continue from (0: none)."""
    checkpoint_dir = latest(out_dir) if cfg.train.resume else None
    if checkpoint_dir is None:
        return 0
    start = load(checkpoint_dir, model, optimizer, scheduler, cfg)
    distributed.print0(f"resumed from {checkpoint_dir} at step {start}")
    return start


def export(out_dir: Path) -> Path:
    """out_dir/final: a copy of the latest checkpoint's model directory (a checkpoint or an adapter),
    replaced atomically; returns its path."""
    final = out_dir / "final"
    if distributed.rank() == 0:
        source = latest(out_dir)
        assert source is not None, "export follows the checkpoint of the last step"
        tmp = Path(tempfile.mkdtemp(dir=out_dir, prefix=".final."))
        shutil.rmtree(tmp)  # copytree creates it: the name was only reserved
        shutil.copytree(source / "model", tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    distributed.barrier()
    return final
