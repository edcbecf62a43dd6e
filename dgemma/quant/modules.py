"""Quantized stand-ins for nn.Linear and the stacked experts, swapped in from outside the model.

Both keep the codes under the weight's own name (`weight`, `gate_up_proj`, `down_proj`) and the scales
beside it (`weight_scale`, ...), so a quantized model's state dict has the checkpoint's names plus
`*_scale` entries. The forward passes dequantize one tile of output rows (or one expert) at a time into
the activation dtype and multiply: no dequantized copy of a whole layer outlives the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model import Experts, gelu_tanh
from ..moe import experts_by_expert
from .formats import Quantized, check_mode, dequantize, quantize, quantize_matrices
from .kernels import quantized_matmul

TILE_ELEMENTS = 1 << 22  # dequantized elements per tile (16 MB in fp32)


def _empty_codes(mode: str, shape: tuple[int, ...], group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-filled codes and scales of the right dtypes and shapes for a weight of `shape`."""
    *lead, n_out, n_in = shape
    if mode == "int4":
        return (
            torch.zeros(*lead, n_out, n_in // 2, dtype=torch.uint8),
            torch.zeros(*lead, n_out, n_in // group_size, dtype=torch.bfloat16),
        )
    dtype = torch.int8 if mode == "int8" else torch.float8_e4m3fn
    return torch.zeros(*shape, dtype=dtype), torch.zeros(*lead, n_out, 1, dtype=torch.float32)


class QuantLinear(nn.Module):
    """y = x W^T with W stored quantized (`mode`: int8, int4 or fp8); no bias (DiffusionGemma has none)."""

    def __init__(self, in_features: int, out_features: int, mode: str, group_size: int = 64):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.mode, self.group_size = check_mode(mode), group_size
        self.kernel: str | None = None  # set by dgemma.quant.use_kernels
        codes, scales = _empty_codes(mode, (out_features, in_features), group_size)
        self.register_buffer("weight", codes)
        self.register_buffer("weight_scale", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, group_size: int = 64) -> QuantLinear:
        if linear.bias is not None:
            raise ValueError("QuantLinear has no bias; DiffusionGemma's linear layers have none")
        module = cls(linear.in_features, linear.out_features, mode, group_size)
        module.set_weight(linear.weight.detach())
        return module

    def set_weight(self, w: torch.Tensor) -> None:
        """Quantize `w` [out, in] into this module's buffers."""
        q = quantize(w, self.mode, self.group_size)
        self.weight = q.codes.to(self.weight.device)
        self.weight_scale = q.scales.to(self.weight.device)

    def quantized(self) -> Quantized:
        return Quantized(
            self.mode, self.weight, self.weight_scale, (self.out_features, self.in_features), self.group_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized()
        if self.kernel:
            return quantized_matmul(x, q)
        tile = max(1, TILE_ELEMENTS // self.in_features)
        if tile >= self.out_features:
            return F.linear(x, dequantize(q, x.dtype))
        return torch.cat(
            [
                F.linear(x, dequantize(q, x.dtype, rows=slice(start, start + tile)))
                for start in range(0, self.out_features, tile)
            ],
            dim=-1,
        )

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        kernel = f", kernel={self.kernel}" if self.kernel else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}{group}{kernel}"


class QuantExperts(nn.Module):
    """The stacked GeGLU experts (gate_up_proj [E, 2I, M], down_proj [E, M, I]) stored quantized.

    Token-expert pairs are sorted by expert, and each expert that any token chose is dequantized once
    per call (one read of its codes), used for all its tokens, and dropped.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, mode: str, group_size: int = 64):
        super().__init__()
        self.mode, self.group_size = check_mode(mode), group_size
        self.kernel: str | None = None  # set by dgemma.quant.use_kernels
        self.shapes = {
            "gate_up_proj": (num_experts, 2 * intermediate_size, hidden_size),
            "down_proj": (num_experts, hidden_size, intermediate_size),
        }
        for name, shape in self.shapes.items():
            codes, scales = _empty_codes(mode, shape, group_size)
            self.register_buffer(name, codes)
            self.register_buffer(name + "_scale", scales)

    @classmethod
    def from_experts(cls, experts: Experts, mode: str, group_size: int = 64) -> QuantExperts:
        e, two_i, m = experts.gate_up_proj.shape
        module = cls(e, m, two_i // 2, mode, group_size)
        module.set_weight("gate_up_proj", experts.gate_up_proj.detach())
        module.set_weight("down_proj", experts.down_proj.detach())
        return module

    def set_weight(self, name: str, w: torch.Tensor) -> None:
        """Quantize the stacked weight `name` (expert by expert, so only one is ever in fp32)."""
        if tuple(w.shape) != self.shapes[name]:
            raise ValueError(f"{name}: expected shape {self.shapes[name]}, got {tuple(w.shape)}")
        codes, scales = quantize_matrices(w, self.mode, self.group_size)
        getattr(self, name).copy_(codes)
        getattr(self, name + "_scale").copy_(scales)

    def quantized(self, name: str, e: int) -> Quantized:
        shape = self.shapes[name][1:]
        return Quantized(self.mode, getattr(self, name)[e], getattr(self, name + "_scale")[e], shape, self.group_size)

    def expert(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s dequantized weight `name`."""
        return dequantize(self.quantized(name, e), dtype)

    def _linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        if self.kernel:
            return quantized_matmul(x, self.quantized(name, e))
        return F.linear(x, self.expert(name, e, x.dtype))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = self._linear(rows, "gate_up_proj", e).chunk(2, dim=-1)
            return self._linear(gelu_tanh(gate) * up, "down_proj", e)

        return experts_by_expert(x, weights, index, self.shapes["gate_up_proj"][0], expert)

    def extra_repr(self) -> str:
        e, two_i, m = self.shapes["gate_up_proj"]
        group = f", group_size={self.group_size}" if self.mode == "int4" else ""
        kernel = f", kernel={self.kernel}" if self.kernel else ""
        return f"experts={e}, hidden={m}, intermediate={two_i // 2}, mode={self.mode}{group}{kernel}"
