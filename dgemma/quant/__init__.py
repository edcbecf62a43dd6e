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
from .modules import QuantExperts, QuantLinear

QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

__all__ = [
    "MODES",
    "QuantExperts",
    "QuantLinear",
    "Quantized",
    "dequantize",
    "quantize",
    "quantize_model",
    "targets",
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


def quantize_model(model: DiffusionGemma, mode: str, group_size: int = 64) -> DiffusionGemma:
    """Swap the policy's modules for quantized ones (in place; returns the model)."""
    check_mode(mode)
    for name in targets(model):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        if isinstance(module, Experts):
            swapped = QuantExperts.from_experts(module, mode, group_size)
        else:
            swapped = QuantLinear.from_linear(module, mode, group_size)
        setattr(
            parent,
            child,
            swapped.to(module.gate_up_proj.device if isinstance(module, Experts) else module.weight.device),
        )
    model.quantization = {"mode": mode, "group_size": group_size if mode == "int4" else None}
    return model
