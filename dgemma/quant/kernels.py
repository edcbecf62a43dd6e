"""Integer and fp8 matmuls for quantized weights, from PyTorch's own ops, as an opt-in fast path.

`use_kernels(model)` runs int8 / fp8 modules as `torch._int_mm` / `torch._scaled_mm` with activations
quantized per token, and nvfp4 as W4A4 where the GPU has native FP4 matmuls (emulated on request).
Details: docs/quantization.md, "Kernels" and "How the code is laid out".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import FP8_MAX, Quantized, dequantize, quantize_nvfp4

KERNELS = {"int8": "int_mm", "fp8": "scaled_mm", "nvfp4": "scaled_mm_fp4"}


def native_fp4(device: torch.device | str) -> bool:
    """Whether `device` multiplies FP4 operands natively (CUDA compute capability >= 10: Blackwell)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "float4_e2m1fn_x2"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 10


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [rows, K / 16] in cuBLAS's layout for block-scaled matmuls, flattened: the matrix
    zero-padded to 128 rows x 4 columns per tile, each tile stored as 32 rows of 16 (row r of the tile at
    (r % 32, 4 * (r // 32) + column))."""
    rows, cols = scales.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    padded = F.pad(scales.view(torch.uint8), (0, 4 * col_tiles - cols, 0, 128 * row_tiles - rows))
    tiles = padded.view(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)  # [rt, ct, r%32, r//32, c]
    return tiles.reshape(-1).view(scales.dtype)


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
    token, or an nvfp4 weight (W4A4); returns x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if q.mode == "nvfp4":
        y = nvfp4_native(x2, q) if native_fp4(x.device) else nvfp4_emulated(x2, q)
        return y.to(x.dtype).reshape(*lead, -1)
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


def nvfp4_native(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """x [M, K] @ W^T on the FP4 tensor cores: x quantized to NVFP4, both operands' codes as
    float4_e2m1fn_x2 with swizzled e4m3 block scales, the result times 1 / (x's global scale) and each
    output column times 1 / (its row's global scale); fp32 [M, N]."""
    xq = quantize_nvfp4(x)
    codes, scales = xq.codes, xq.scales
    codes, m = _pad_rows(codes, 128, 128)
    scales, _ = _pad_rows(scales.view(torch.uint8), 128, 128)
    fp4 = torch.float4_e2m1fn_x2
    y = torch._scaled_mm(
        codes.view(fp4),
        q.codes.view(fp4).t(),
        scale_a=to_blocked(scales.view(torch.float8_e4m3fn)),
        scale_b=to_blocked(q.scales),
        out_dtype=torch.bfloat16,
    )[:m].float()
    return y / xq.global_scale.reshape(()) / q.global_scale.reshape(1, -1)


def nvfp4_emulated(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """What nvfp4_native computes, in fp32 on any device: x quantized to NVFP4 and dequantized, times the
    dequantized weight; fp32 [M, N]."""
    return F.linear(dequantize(quantize_nvfp4(x)), dequantize(q))


def reference_matmul(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """What quantized_matmul computes, on dequantized activations and weights (for tests)."""
    lead, k = x.shape[:-1], x.shape[-1]
    if q.mode == "nvfp4":
        return nvfp4_emulated(x.reshape(-1, k), q).to(x.dtype).reshape(*lead, -1)
    xq, xs = quantize_rows(x.reshape(-1, k), q.mode)
    return F.linear(xq.float() * xs, dequantize(q)).to(x.dtype).reshape(*lead, -1)
