"""Integer and fp8 matmuls for quantized weights, from PyTorch's own ops, as an opt-in fast path.

The default forward of a quantized module is weight-only: dequantize a tile, multiply in the activation
dtype. `use_kernels(model)` switches int8 and fp8 modules to a matmul on the quantized values
themselves, with the activations quantized per token on the fly (dynamic W8A8 / FP8-dynamic, as the
published FP8 checkpoints run): `torch._int_mm` (int8 x int8 -> int32) and `torch._scaled_mm` (fp8 with
row-wise scales). Both ops exist on CPU and CUDA in PyTorch 2.13; on CUDA they read half (int8, fp8)
the bytes of a bf16 weight and use the tensor cores. int4 has no such portable op and keeps the
dequantizing path. Each kernel is tested against the same computation on dequantized values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import FP8_MAX, Quantized

KERNELS = {"int8": "int_mm", "fp8": "scaled_mm"}


def quantize_rows(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) symmetric quantization of activations [M, K]: codes and fp32 scales [M, 1]."""
    x = x.float()
    absmax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    if mode == "int8":
        scale = absmax / 127.0
        return torch.round(x / scale).clamp_(-127, 127).to(torch.int8), scale
    scale = absmax / FP8_MAX
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def _pad_rows(x: torch.Tensor, multiple: int, minimum: int) -> tuple[torch.Tensor, int]:
    m = x.shape[0]
    target = max(minimum, -(-m // multiple) * multiple)
    return (F.pad(x, (0, 0, 0, target - m)) if target != m else x), m


def quantized_matmul(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """x [..., K] @ W^T for an int8 or fp8 weight W [N, K] (per-row scales), activations quantized per
    token; returns x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    xq, xs = quantize_rows(x2, q.mode)
    if x.is_cuda:  # the CUDA kernels want more than 16 rows and multiples of 16
        xq, m = _pad_rows(xq, 16, 32)
        xs, _ = _pad_rows(xs, 16, 32)
    else:
        m = x2.shape[0]
    if q.mode == "int8":
        acc = torch._int_mm(xq, q.codes.t())  # int32, exact
        y = acc[:m].float() * xs[:m] * q.scales.reshape(1, -1)
    else:
        y = torch._scaled_mm(
            xq, q.codes.t(), scale_a=xs, scale_b=q.scales.reshape(1, -1).float(), out_dtype=torch.bfloat16
        )[:m].float()
    return y.to(x.dtype).reshape(*lead, -1)


def reference_matmul(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """What quantized_matmul computes, on dequantized activations and weights (for tests)."""
    from .formats import dequantize

    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_rows(x.reshape(-1, k), q.mode)
    return F.linear(xq.float() * xs, dequantize(q)).to(x.dtype).reshape(*lead, -1)


def use_kernels(model: torch.nn.Module, enable: bool = True) -> torch.nn.Module:
    """Switch the model's int8 / fp8 modules to the integer / fp8 matmuls (or back); returns the model."""
    from .modules import QuantExperts, QuantLinear

    for module in model.modules():
        if isinstance(module, QuantLinear | QuantExperts):
            per_row = all(spec.group_size is None for spec in module.specs.values())  # the kernels' scales
            module.kernel = KERNELS.get(module.mode) if enable and per_row else None
    return model
