"""Weight-only quantization (int8, int4, fp8, nvfp4) applied to a model from outside, as module swaps.

    dgemma.quant.quantize_model(model, "int4", group_size=64)

The attention projections, the dense MLP and the experts are quantized (over 95% of the 26B-A4B's bytes);
the router, norms, layer scalars, the tied embedding and the self-conditioning MLP keep the model's dtype
(docs/quantization.md says why, part by part).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..model.model import DiffusionGemma, Experts
from .formats import MODES, Quantized, QuantSpec, check_mode, dequantize, quantize
from .modules import QuantExperts, QuantLinear, use_kernels

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Linears that vLLM runs as one matmul (qkv_proj, gate_up_proj): NVFP4 gives each group one global scale
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
Spec = QuantSpec | tuple[QuantSpec, QuantSpec]  # one module's; the experts' may be (gate_up_proj, down_proj)

__all__ = [
    "MODES",
    "QuantExperts",
    "QuantLinear",
    "QuantSpec",
    "Quantized",
    "check_mode",
    "dequantize",
    "describe",
    "fused_amax",
    "fused_group",
    "quantize",
    "quantize_model",
    "quantized_buffer_names",
    "quantized_weight_names",
    "specs_of",
    "swap_modules",
    "targets",
    "use_kernels",
]


def targets(model: DiffusionGemma) -> list[str]:
    """Names of the modules the policy quantizes: the layers' attention, MLP and experts."""
    out = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if parts[0] != "layers":
            continue  # embeddings and the self-conditioning MLP stay as they are
        if isinstance(module, Experts) or (isinstance(module, nn.Linear) and parts[-1] in QUANTIZED_LINEARS):
            out.append(name)
    return out


def fused_group(name: str) -> list[str]:
    """The Linears vLLM fuses the layer Linear `name` with, itself included (a layer's q / k / v
    projections, its dense MLP's gate / up), in FUSED_GROUPS order; [name] for any other module."""
    parent, _, child = name.rpartition(".")
    for group in FUSED_GROUPS:
        if child in group and parent.startswith("layers."):
            return [f"{parent}.{c}" for c in group]
    return [name]


def fused_amax(name: str, weight_of: Callable[[str], torch.Tensor | None]) -> torch.Tensor | None:
    """max|w| over the fused group of the Linear `name` (fused_group), each member's weight given by
    `weight_of(member)` (None for a member the model lacks: no v_proj on global layers); None for a
    Linear in no group. NVFP4 derives the group's one global scale from it."""
    group = fused_group(name)
    if len(group) == 1:
        return None
    weights = [w for w in map(weight_of, group) if w is not None]
    return torch.stack([w.detach().abs().amax().float() for w in weights]).amax()


def _linear_weight(model: DiffusionGemma, name: str) -> torch.Tensor | None:
    parent, _, child = name.rpartition(".")
    linear = getattr(model.get_submodule(parent), child, None)
    return linear.weight if isinstance(linear, nn.Linear) else None


def describe(mode: str, group_size: int | None) -> dict:
    """The `quantization` block of config.json (and `model.quantization`) for dgemma's policy in one mode."""
    return describe_spec(QuantSpec.of(mode, group_size or 64))


def describe_spec(spec: QuantSpec) -> dict:
    """`describe` for one spec (int4 codes read as q + 0.5 unless the block says `zero`)."""
    block = {
        "quant_method": "dgemma",
        "mode": spec.mode,
        "group_size": spec.group_size if spec.mode == "int4" else None,
        "modules": "layers.*: self_attn.{q,k,v,o}_proj, mlp.*, experts",
    }
    return block | ({"zero": spec.zero} if spec.zero != "mid" else {})


def describe_specs(specs: dict[str, Spec]) -> dict:
    """The `quantization` block of a model whose modules are stored in several ways (one read from a
    compressed-tensors checkpoint): every quantized module's spec by name."""

    def one(spec: Spec) -> dict:
        if isinstance(spec, QuantSpec):
            return spec.to_dict()
        return {"gate_up_proj": spec[0].to_dict(), "down_proj": spec[1].to_dict()}

    return {"quant_method": "dgemma", "mode": "per-module", "modules": {n: one(s) for n, s in specs.items()}}


def specs_of(block: dict, model: DiffusionGemma) -> dict[str, Spec]:
    """The module specs a `quantization` block (describe or describe_specs) stands for."""
    if block.get("mode") != "per-module":
        spec = QuantSpec.of(block["mode"], block.get("group_size") or 64, block.get("zero", "mid"))
        return dict.fromkeys(targets(model), spec)
    out: dict[str, Spec] = {}
    for name, spec in block["modules"].items():
        if "gate_up_proj" in spec:
            out[name] = (QuantSpec(**spec["gate_up_proj"]), QuantSpec(**spec["down_proj"]))
        else:
            out[name] = QuantSpec(**spec)
    return out


def swap_modules(model: DiffusionGemma, specs: dict[str, Spec], *, empty: bool = False) -> None:
    """Replace the named modules by quantized ones stored as their spec: quantizing their weights
    (dgemma's own formats), or (`empty`) with zero-filled buffers of the right shapes, to be filled from a
    checkpoint."""
    amax = {  # nvfp4: one global scale per fused group, from the full-precision weights before any swap
        name: fused_amax(name, lambda m: _linear_weight(model, m))
        for name, spec in specs.items()
        if not empty and isinstance(spec, QuantSpec) and spec.mode == "nvfp4"
    }
    for name, spec in specs.items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        if isinstance(module, Experts):
            e, two_i, m = module.gate_up_proj.shape
            if empty:
                swapped = QuantExperts(e, m, two_i // 2, *(spec if isinstance(spec, tuple) else (spec,)))
            else:
                swapped = QuantExperts.from_experts(module, spec).to(module.gate_up_proj.device)
        elif isinstance(module, nn.Linear) and isinstance(spec, QuantSpec):
            if empty:
                swapped = QuantLinear(module.in_features, module.out_features, spec)
            else:
                swapped = QuantLinear.from_linear(module, spec, amax.get(name)).to(module.weight.device)
        else:
            raise ValueError(f"{name} is a {type(module).__name__}; {spec} is for linear layers or experts")
        setattr(parent, child, swapped)


def quantized_weight_names(model: DiffusionGemma) -> set[str]:
    """State-dict names of the full-precision weights the quantized modules stand for."""
    names = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            names.add(f"{name}.weight")
        elif isinstance(module, QuantExperts):
            names |= {f"{name}.gate_up_proj", f"{name}.down_proj"}
    return names


def quantized_buffer_names(model: DiffusionGemma) -> set[str]:
    """State-dict names of everything the quantized modules store (codes, scales, zero points, ...)."""
    return {
        f"{name}.{buffer}"
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear | QuantExperts)
        for buffer, _ in module.named_buffers(recurse=False)
    }


def quantize_model(model: DiffusionGemma, mode: str | QuantSpec, group_size: int = 64) -> DiffusionGemma:
    """Quantize a loaded model in place (the policy's modules swapped; returns the model)."""
    spec = mode if isinstance(mode, QuantSpec) else QuantSpec.of(mode, group_size)
    swap_modules(model, dict.fromkeys(targets(model), spec))
    model.quantization = describe_spec(spec)
    return model
