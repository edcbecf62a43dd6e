"""LoRA adapters with peft, on dgemma's single shared stack.

Everything that knows how peft lays a model out lives here: applying adapters, saving and restoring them,
the merged export (`dgemma merge`). Targets, frozen parts and the adapter format: docs/training.md, "LoRA";
the layers peft lacks (quantized linears, experts) are in lora_layers.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from ..model.model import DiffusionGemma

TARGETS = {  # module names of the text stack (the vision tower's projections have the same last names)
    "attention": r"layers\.\d+\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
    "mlp": r"layers\.\d+\.mlp\.(gate_proj|up_proj|down_proj)",
    "self_conditioning": r"self_conditioning\.(gate_proj|up_proj|down_proj)",
    "experts": r"layers\.\d+\.experts",  # both stacked weights, per-expert or shared factors (lora_layers.py)
}
DEFAULT_TARGETS = ("attention", "mlp")


def target_regex(targets: list[str] | tuple[str, ...]) -> str:
    unknown = [t for t in targets if t not in TARGETS]
    if unknown or not targets:
        raise ValueError(f"LoRA targets must be a non-empty list from {sorted(TARGETS)} (got {list(targets)})")
    return "(" + "|".join(TARGETS[t] for t in targets) + ")"  # peft matches the whole module name


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
    experts: str = "per_expert",
    dtype: torch.dtype = torch.float32,
):
    """Wrap `model` (bf16 or quantized) with fresh LoRA adapters (only they are trainable); returns the
    peft model. `experts` ("per_expert" or "shared") is the experts' adapter kind when they are a target;
    `dtype` the adapters' (fp32, as peft keeps them, or bf16: half the bytes for them, their gradients
    and their AdamW states, which per-expert factors of a large MoE need)."""
    peft = _peft()

    if r <= 0 or alpha <= 0 or not 0 <= dropout < 1:
        raise ValueError(
            f"LoRA needs r > 0, alpha > 0 and 0 <= dropout < 1 (got r={r}, alpha={alpha}, dropout={dropout})"
        )
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_regex(targets), bias="none"
    )
    config._register_custom_module(_custom_modules(experts))
    peft_model = peft.get_peft_model(model, config)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data = p.data.to(dtype)
    return peft_model


def _custom_modules(experts: str) -> dict:
    from .lora_layers import custom_modules  # imports peft, like the functions above

    return custom_modules(experts)


def _saved_experts_kind(path: Path) -> str:
    """Whether a saved adapter's expert factors are per expert or shared (from their shapes)."""
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            if ".experts.lora_A." in key:
                return "shared" if f.get_slice(key).get_shape()[0] == 1 else "per_expert"
    return "per_expert"


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (a DiffusionGemma wrapped with adapters)."""
    peft = sys.modules.get("peft")  # a model can only be adapted once peft is imported
    return peft is not None and isinstance(model, peft.PeftModel)


def base_model(model: torch.nn.Module) -> DiffusionGemma:
    """The DiffusionGemma under `model`'s adapters (`model` itself when it has none); the adapted layers
    stay in place, so sharding or inspecting it covers the adapters too."""
    return model.get_base_model() if is_adapted(model) else model


def save_adapter(model: torch.nn.Module, directory: Path, state_dict: dict[str, torch.Tensor]) -> None:
    """Write the adapters of peft model `model` to `directory` in peft's format, taking their values from
    `state_dict` (the model's full state dict, as gathered from every process)."""
    model.save_pretrained(str(directory), state_dict=state_dict)


def adapter_state(model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The adapter tensors that `save_adapter` wrote to `directory`, under peft model `model`'s state-dict
    names (the same on every process, so a sharded model can load them collectively)."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(directory) / "adapter_model.safetensors"))
    # the file drops the adapter's name ("default") from each key
    return {key: saved[key.replace(".default.", ".")] for key in model.state_dict() if "lora_" in key}


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
    config = peft.LoraConfig.from_pretrained(str(path))
    config._register_custom_module(_custom_modules(_saved_experts_kind(path)))
    try:
        peft_model = peft.PeftModel.from_pretrained(model, str(path), config=config, is_trainable=trainable)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"the adapter in {path} does not fit this model: {e}") from e
    if merge:
        with torch.no_grad():
            return peft_model.merge_and_unload()
    return peft_model
