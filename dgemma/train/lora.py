"""LoRA adapters with peft, on dgemma's single shared stack.

dgemma runs encode and denoise through the same modules, so one adapter serves both passes (as in Google's
and NeMo's recipes); there is no separate encoder copy whose delta could be merged twice. The default
targets are the attention projections and the dense GeGLU MLP of every layer; experts, router,
embeddings and the self-conditioning block stay frozen. Adapters are saved in peft's format
(adapter_config.json + adapter_model.safetensors) under dgemma's module names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..model import DiffusionGemma

TARGETS = {
    "attention": r"self_attn\.(q_proj|k_proj|v_proj|o_proj)",
    "mlp": r"mlp\.(gate_proj|up_proj|down_proj)",
    "self_conditioning": r"self_conditioning\.(gate_proj|up_proj|down_proj)",
}
DEFAULT_TARGETS = ("attention", "mlp")


def target_regex(targets: list[str] | tuple[str, ...]) -> str:
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"LoRA targets must be a non-empty list from {sorted(TARGETS)} (got {list(targets)})")
    return r".*\.(" + "|".join(TARGETS[t] for t in targets) + r")"


def _peft():
    try:
        import peft
    except ImportError as e:
        raise ImportError("LoRA needs the peft package: pip install 'dgemma[lora]' (or pip install peft)") from e
    return peft


def apply_lora(
    model: DiffusionGemma,
    r: int = 16,
    alpha: int = 32,
    dropout: float = 0.0,
    targets: list[str] | tuple[str, ...] = DEFAULT_TARGETS,
):
    """Wrap `model` with fresh LoRA adapters (only they are trainable); returns the peft model."""
    peft = _peft()

    if r <= 0 or alpha <= 0 or not 0 <= dropout < 1:
        raise ValueError(
            f"LoRA needs r > 0, alpha > 0 and 0 <= dropout < 1 (got r={r}, alpha={alpha}, dropout={dropout})"
        )
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_regex(targets), bias="none"
    )
    return peft.get_peft_model(model, config)


def _check_adapter_dir(path: Path) -> None:
    if not (path / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{path} is not a LoRA adapter directory (no adapter_config.json)")
    if not (path / "adapter_model.safetensors").is_file():
        pickled = [p.name for p in path.glob("adapter_model.*")]
        hint = f" (found {pickled}: dgemma loads safetensors only)" if pickled else ""
        raise FileNotFoundError(f"{path} has no adapter_model.safetensors{hint}")
    config = json.loads((path / "adapter_config.json").read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: only LoRA adapters are supported (peft_type {config.get('peft_type')!r})")


def load_adapter(model: DiffusionGemma, path: str | Path, *, merge: bool = True, trainable: bool = False):
    """Attach a saved adapter to `model`. With `merge` (for inference) the deltas are added to the weights
    and a plain DiffusionGemma is returned; otherwise the peft model."""
    path = Path(path)
    _check_adapter_dir(path)
    peft = _peft()
    try:
        peft_model = peft.PeftModel.from_pretrained(model, str(path), is_trainable=trainable)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"the adapter in {path} does not fit this model: {e}") from e
    if merge:
        with torch.no_grad():
            return peft_model.merge_and_unload()
    return peft_model
