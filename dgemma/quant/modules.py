"""Quantized stand-ins for nn.Linear and the stacked experts, swapped in from outside the model.

Codes stay under the weight's own name and scales beside it (`weight_scale`, `*_zero_point`,
`*_global_scale`); the forward dequantizes one tile of output rows (or one expert) at a time, and so does
the backward of `dequantized_linear` (LoRA over a frozen quantized base: docs/qlora.md), which keeps only
the codes (docs/quantization.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model.model import Experts, gelu_tanh
from ..model.moe import experts_by_expert
from .formats import Quantized, QuantSpec, dequantize, quantized_buffers
from .kernels import KERNELS, native_fp4, quantized_matmul

TILE_ELEMENTS = 1 << 22  # dequantized elements per tile (16 MB in fp32)


def empty_buffers(spec: QuantSpec, shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Zero-filled buffers of the right dtypes and shapes for a weight of `shape` stored as `spec`, by
    suffix of the weight's name: "" (the codes), "_scale", "_zero_point", "_global_scale"."""
    *lead, n_out, n_in = shape
    groups = spec.groups(n_in)
    if spec.mode in ("int8", "fp8"):
        dtype = torch.int8 if spec.mode == "int8" else torch.float8_e4m3fn
        return {"": torch.zeros(*shape, dtype=dtype), "_scale": torch.zeros(*lead, n_out, groups)}
    scale_dtype = torch.bfloat16 if spec.mode == "int4" else torch.float8_e4m3fn
    out = {
        "": torch.zeros(*lead, n_out, n_in // 2, dtype=torch.uint8),
        "_scale": torch.zeros(*lead, n_out, groups, dtype=scale_dtype),
    }
    if spec.zero == "asymmetric":
        out["_zero_point"] = torch.zeros(*lead, n_out, groups, dtype=torch.uint8)
    if spec.mode == "nvfp4":
        out["_global_scale"] = torch.ones(*lead, n_out, 1)
    return out


def check_shape(spec: QuantSpec, shape: tuple[int, ...]) -> None:
    """Refuse a weight `spec` cannot store (groups that do not divide its rows, odd widths)."""
    n_in = shape[-1]
    g = spec.group_size or n_in
    if n_in % g or (spec.mode in ("int4", "nvfp4") and g % 2):
        raise ValueError(
            f"{spec.mode} group_size {g} must be even and divide the input size {n_in} (a weight of shape "
            f"{tuple(shape)})"
        )


def _check_own(spec: QuantSpec) -> None:
    if not spec.writable:
        raise ValueError(f"dgemma reads {spec.mode} with {spec.zero} zero points but does not quantize into it")


def _quantized(module: nn.Module, name: str, shape: tuple[int, ...], index: int | None = None) -> Quantized:
    """The weight `name` of a quantized module (or matrix `index` of a stack) as a Quantized view."""
    spec = module.specs[name]

    def part(suffix: str) -> torch.Tensor | None:
        t = getattr(module, name + suffix, None)
        return t if t is None or index is None else t[index]

    return Quantized(
        spec.mode,
        part(""),
        part("_scale"),
        shape,
        spec.group_size or shape[-1],
        spec.zero,
        part("_zero_point"),
        part("_global_scale"),
    )


class _DequantizedLinear(torch.autograd.Function):
    """y = x W^T for a frozen quantized W, dequantized tile by tile in the forward and again in the
    backward pass (which saves no dequantized weight, only a reference to the codes)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, q: Quantized, tile: int) -> torch.Tensor:
        ctx.q, ctx.tile = q, tile
        return _tiled_linear(x, q, tile)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, tile, n_out = ctx.q, ctx.tile, ctx.q.shape[-2]
        dx = None
        for start in range(0, n_out, tile):
            rows = slice(start, start + tile)
            part = grad[..., rows] @ dequantize(q, grad.dtype, rows=rows)
            dx = part if dx is None else dx + part
        return dx, None, None


def _tiled_linear(x: torch.Tensor, q: Quantized, tile: int) -> torch.Tensor:
    if tile >= q.shape[-2]:
        return F.linear(x, dequantize(q, x.dtype))
    return torch.cat(
        [F.linear(x, dequantize(q, x.dtype, rows=slice(a, a + tile))) for a in range(0, q.shape[-2], tile)], dim=-1
    )


def dequantized_linear(x: torch.Tensor, q: Quantized) -> torch.Tensor:
    """x W^T for the quantized weight `q` [out, in], dequantized into x's dtype a tile of output rows at a
    time (at most TILE_ELEMENTS values); when x needs a gradient, the backward pass dequantizes again
    instead of keeping the weight (the weights themselves are frozen: no gradient for them)."""
    tile = max(1, TILE_ELEMENTS // q.shape[-1])
    if torch.is_grad_enabled() and x.requires_grad:
        return _DequantizedLinear.apply(x, q, tile)
    return _tiled_linear(x, q, tile)


def _describe(spec: QuantSpec, kernel: str | None) -> str:
    group = f", group_size={spec.group_size}" if spec.mode == "int4" else ""
    zero = f", zero={spec.zero}" if spec.zero != "mid" else ""
    return f"mode={spec.mode}{group}{zero}" + (f", kernel={kernel}" if kernel else "")


class QuantLinear(nn.Module):
    """y = x W^T with W stored quantized as `spec` (int8, int4, fp8 or nvfp4); no bias (DiffusionGemma
    has none)."""

    def __init__(self, in_features: int, out_features: int, spec: QuantSpec):
        super().__init__()
        check_shape(spec, (out_features, in_features))
        self.in_features, self.out_features, self.spec = in_features, out_features, spec
        self.specs = {"weight": spec}
        self.kernel: str | None = None  # set by dgemma.quant.use_kernels
        for suffix, t in empty_buffers(spec, (out_features, in_features)).items():
            self.register_buffer("weight" + suffix, t)

    @property
    def mode(self) -> str:
        return self.spec.mode

    @classmethod
    def from_linear(cls, linear: nn.Linear, spec: QuantSpec, amax: torch.Tensor | None = None) -> QuantLinear:
        if linear.bias is not None:
            raise ValueError("QuantLinear has no bias; DiffusionGemma's linear layers have none")
        module = cls(linear.in_features, linear.out_features, spec)
        module.set_weight(linear.weight.detach(), amax)
        return module

    def set_weight(self, w: torch.Tensor, amax: torch.Tensor | None = None) -> None:
        """Quantize `w` [out, in] into this module's buffers (dgemma's own format for the mode; nvfp4's
        global scale from `amax`, its fused group's max|w|, when given)."""
        _check_own(self.spec)
        for suffix, t in quantized_buffers(w, self.spec, amax).items():
            setattr(self, "weight" + suffix, t.to(self.weight.device))

    def quantized(self) -> Quantized:
        return _quantized(self, "weight", (self.out_features, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.quantized()
        return quantized_matmul(x, q) if self.kernel else dequantized_linear(x, q)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + _describe(self.spec, self.kernel)


class QuantExperts(nn.Module):
    """The stacked GeGLU experts (gate_up_proj [E, 2I, M], down_proj [E, M, I]) stored quantized.

    Token-expert pairs are sorted by expert, and each expert that any token chose is dequantized once
    per call (one read of its codes), used for all its tokens, and dropped.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        spec: QuantSpec,
        down_spec: QuantSpec | None = None,
    ):
        super().__init__()
        self.specs = {"gate_up_proj": spec, "down_proj": down_spec or spec}  # files may store them differently
        self.kernel: str | None = None  # set by dgemma.quant.use_kernels
        self.shapes = {
            "gate_up_proj": (num_experts, 2 * intermediate_size, hidden_size),
            "down_proj": (num_experts, hidden_size, intermediate_size),
        }
        for name, shape in self.shapes.items():
            check_shape(self.specs[name], shape)
            for suffix, t in empty_buffers(self.specs[name], shape).items():
                self.register_buffer(name + suffix, t)

    @property
    def qweight(self) -> torch.Tensor:
        """The codes of gate_up_proj: where peft (the name GPTQ / AWQ modules use) finds a quantized
        module's device when it wraps it with LoRA (the module has no parameters)."""
        return self.gate_up_proj

    @property
    def mode(self) -> str:
        """The mode of both weights, or "mixed"."""
        modes = {s.mode for s in self.specs.values()}
        return modes.pop() if len(modes) == 1 else "mixed"

    @classmethod
    def from_experts(cls, experts: Experts, spec: QuantSpec) -> QuantExperts:
        e, two_i, m = experts.gate_up_proj.shape
        module = cls(e, m, two_i // 2, spec)
        module.set_weight("gate_up_proj", experts.gate_up_proj.detach())
        module.set_weight("down_proj", experts.down_proj.detach())
        return module

    def set_weight(self, name: str, w: torch.Tensor) -> None:
        """Quantize the stacked weight `name` (expert by expert, so only one is ever in fp32)."""
        if tuple(w.shape) != self.shapes[name]:
            raise ValueError(f"{name}: expected shape {self.shapes[name]}, got {tuple(w.shape)}")
        spec = self.specs[name]
        _check_own(spec)
        for suffix, t in quantized_buffers(w, spec).items():
            getattr(self, name + suffix).copy_(t)

    def set_expert(self, name: str, e: int, w: torch.Tensor) -> None:
        """Quantize `w` [out, in] into expert `e`'s slice of the stacked weight `name` (a LoRA merge)."""
        spec = self.specs[name]
        _check_own(spec)
        for suffix, t in quantized_buffers(w, spec).items():
            getattr(self, name + suffix)[e].copy_(t)

    def quantized(self, name: str, e: int) -> Quantized:
        return _quantized(self, name, self.shapes[name][1:], e)

    def quantized_stack(self, name: str) -> Quantized:
        """The whole stack `name` (every expert) as one Quantized view."""
        return _quantized(self, name, self.shapes[name])

    def expert(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `e`'s dequantized weight `name`."""
        return dequantize(self.quantized(name, e), dtype)

    def linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """x through expert `e`'s weight `name` (x W_e^T)."""
        q = self.quantized(name, e)
        return quantized_matmul(x, q) if self.kernel else dequantized_linear(x, q)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = self.linear(rows, "gate_up_proj", e).chunk(2, dim=-1)
            return self.linear(gelu_tanh(gate) * up, "down_proj", e)

        return experts_by_expert(x, weights, index, self.shapes["gate_up_proj"][0], expert)

    def extra_repr(self) -> str:
        e, two_i, m = self.shapes["gate_up_proj"]
        gate_up, down = self.specs.values()
        if gate_up == down:
            return f"experts={e}, hidden={m}, intermediate={two_i // 2}, " + _describe(gate_up, self.kernel)
        both = f"gate_up: {_describe(gate_up, self.kernel)}; down: {_describe(down, self.kernel)}"
        return f"experts={e}, hidden={m}, intermediate={two_i // 2}, {both}"


def use_kernels(
    model: torch.nn.Module, enable: bool = True, fp4: bool | None = None, modes: tuple[str, ...] | None = None
) -> torch.nn.Module:
    """Switch the model's int8 / fp8 modules to the integer / fp8 matmuls (or back), and nvfp4 ones to
    W4A4 when `fp4` (default: where the model's device has native FP4 matmuls; True elsewhere runs the
    emulation, to measure it); only the modules of `modes` when given; returns the model."""
    for module in model.modules():
        if not isinstance(module, QuantLinear | QuantExperts) or (modes is not None and module.mode not in modes):
            continue
        if module.mode == "nvfp4":
            w4a4 = native_fp4(next(module.buffers()).device) if fp4 is None else fp4
            module.kernel = KERNELS["nvfp4"] if enable and w4a4 else None
        else:
            per_row = all(spec.group_size is None for spec in module.specs.values())  # the kernels' scales
            module.kernel = KERNELS.get(module.mode) if enable and per_row else None
    return model
