"""Weight-only quantization (int8, int4, fp8) applied to a model from outside, as module swaps.

    dgemma.quant.quantize_model(model, "int4", group_size=64)

Policy (what is quantized): the attention projections (q, k, v, o), the dense GeGLU MLP of every layer
and the stacked experts: together over 95% of the 26B-A4B model's bytes, and what every denoising step
reads. What stays in the model's dtype, and why:
- the router (`router.proj`, scales): tiny, and a rounding error there changes which experts run, an
  error far larger than any weight's rounding;
- norms, layer scalars: vectors, negligible bytes, and they set the scale of everything after them;
- the token embedding, tied with the LM head: its rows are read one at a time (cheap), the LM head's
  logits feed the sampler's entropy directly, and the self-conditioning soft embedding multiplies
  probabilities by it;
- the self-conditioning MLP: small, and it reads those soft embeddings.
"""

from __future__ import annotations

from torch import nn

from ..model import DiffusionGemma, Experts
from .formats import MODES, Quantized, check_mode, dequantize, quantize
from .kernels import use_kernels
from .modules import QuantExperts, QuantLinear

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

__all__ = [
    "MODES",
    "QuantExperts",
    "QuantLinear",
    "Quantized",
    "check_mode",
    "dequantize",
    "describe",
    "quantize",
    "quantize_model",
    "quantized_weight_names",
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


def describe(mode: str, group_size: int | None) -> dict:
    """The `quantization` block of config.json (and `model.quantization`)."""
    return {
        "quant_method": "dgemma",
        "mode": mode,
        "group_size": group_size if mode == "int4" else None,
        "modules": "layers.*: self_attn.{q,k,v,o}_proj, mlp.*, experts",
    }


def swap_modules(model: DiffusionGemma, mode: str, group_size: int = 64, *, empty: bool = False) -> None:
    """Replace the policy's modules by quantized ones: quantizing their weights, or (`empty`) with
    zero-filled codes of the right shapes, to be filled from a checkpoint."""
    check_mode(mode)
    for name in targets(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        if isinstance(module, Experts):
            e, two_i, m = module.gate_up_proj.shape
            if empty:
                swapped = QuantExperts(e, m, two_i // 2, mode, group_size)
            else:
                swapped = QuantExperts.from_experts(module, mode, group_size).to(module.gate_up_proj.device)
        elif empty:
            swapped = QuantLinear(module.in_features, module.out_features, mode, group_size)
        else:
            swapped = QuantLinear.from_linear(module, mode, group_size).to(module.weight.device)
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


def quantize_model(model: DiffusionGemma, mode: str, group_size: int = 64) -> DiffusionGemma:
    """Quantize a loaded model in place (the policy's modules swapped; returns the model)."""
    swap_modules(model, mode, group_size)
    model.quantization = describe(mode, group_size)
    return model
