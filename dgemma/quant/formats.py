"""Weight-only quantization formats: tensors in, (codes, scales) out, and back.

All formats are symmetric (no zero point) and quantize along the *input* dimension of a weight laid out
as `[..., out, in]` (nn.Linear and the stacked experts alike), so a scale multiplies one output row (or
one group of one row) and dequantization is a broadcast multiply.

- `int8`: one fp32 scale per output row; codes in [-127, 127] (int8).
- `int4`: one bf16 scale per group of `group_size` inputs of a row; codes in [-8, 7] stored two per byte
  (uint8, low nibble first) and read as the midpoints (q + 0.5) * scale, 16 levels symmetric about 0; a
  `[out, in]` weight takes `out * in / 2` bytes plus the scales.
- `fp8`: float8_e4m3fn codes with one fp32 scale per output row (max |w| maps to 448).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODES = ("int8", "int4", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclass
class Quantized:
    """A quantized weight: `codes` and `scales` as stored, plus what is needed to read them back."""

    mode: str
    codes: torch.Tensor  # int8 [.., out, in] | uint8 [.., out, in/2] (int4) | float8_e4m3fn [.., out, in]
    scales: torch.Tensor  # fp32 [.., out, 1] (int8, fp8) | bf16 [.., out, in/group_size] (int4)
    shape: tuple[int, ...]  # the original weight's shape
    group_size: int | None = None

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError("fp8 needs a PyTorch with torch.float8_e4m3fn (2.1 or newer)")
    return mode


def _row_absmax(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)


def quantize(w: torch.Tensor, mode: str, group_size: int = 64) -> Quantized:
    """Quantize a weight `[..., out, in]` (any float dtype; computed in fp32)."""
    check_mode(mode)
    if w.dim() < 2:
        raise ValueError(f"only matrices (or stacks of them) are quantized, got shape {tuple(w.shape)}")
    shape = tuple(w.shape)
    w = w.float()
    if mode == "int8":
        scales = _row_absmax(w) / 127.0
        codes = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
        return Quantized(mode, codes, scales, shape)
    if mode == "fp8":
        scales = _row_absmax(w) / FP8_MAX
        codes = (w / scales).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Quantized(mode, codes, scales, shape)
    n_in = shape[-1]
    if group_size <= 0 or n_in % group_size or group_size % 2:
        raise ValueError(f"int4 group_size must be even and divide the input size {n_in} (got {group_size})")
    groups = w.reshape(*shape[:-1], n_in // group_size, group_size)
    # bf16 scales (0.03 bytes per weight at group 64, not 0.06), rounded before the codes are chosen
    scales = (groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 7.5).to(torch.bfloat16)
    codes = torch.round(groups / scales.float() - 0.5).clamp_(-8, 7).to(torch.int16)  # x = (q + 0.5) s
    return Quantized(mode, pack_int4(codes.reshape(shape)), scales.squeeze(-1), shape, group_size)


def quantize_matrices(w: torch.Tensor, mode: str, group_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of a weight or a stack of them (`[E, out, in]`: one matrix at a time, so only
    one is ever in fp32)."""
    if w.dim() == 2:
        q = quantize(w, mode, group_size)
        return q.codes, q.scales
    parts = [quantize(m, mode, group_size) for m in w]
    return torch.stack([q.codes for q in parts]), torch.stack([q.scales for q in parts])


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [-8, 7] (any int dtype, even last dimension) -> uint8, two per byte, low nibble first,
    each stored offset by 8 (0..15), so reading one back is `nibble - 8` with no sign handling."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [..., n/2] -> int8 codes in [-8, 7], [..., n]."""
    both = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return both.to(torch.int8) - 8


_TABLES: dict[torch.device, torch.Tensor] = {}


def _int4_table(device: torch.device) -> torch.Tensor:
    """byte -> (low nibble - 7.5, high nibble - 7.5), fp32 [256, 2]."""
    if device not in _TABLES:
        b = torch.arange(256, device=device)
        _TABLES[device] = torch.stack(((b & 0xF) - 7.5, (b >> 4) - 7.5), dim=-1).float()
    return _TABLES[device]


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, rows: slice | None = None) -> torch.Tensor:
    """The weight (or only output `rows` of it, on the last-but-one dimension) in `dtype`."""
    codes, scales = q.codes, q.scales
    if rows is not None:
        codes, scales = codes[..., rows, :], scales[..., rows, :]
    if q.mode == "int4":  # value = (q + 0.5) * scale = (nibble - 7.5) * scale
        # one table lookup per byte gives both of its values (2x faster on CPU than shifting and masking)
        c = F.embedding(codes.int(), _int4_table(codes.device))  # [..., n/2, 2]
        g = q.group_size
        c = c.view(*c.shape[:-2], c.shape[-2] // (g // 2), g)
        return (c * scales.float().unsqueeze(-1)).view(*c.shape[:-2], -1).to(dtype)
    return (codes.float() * scales).to(dtype)
