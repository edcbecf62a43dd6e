"""Weight-only quantization formats: tensors in, (codes, scales) out, and back.

int8, int4, fp8 and nvfp4, each along the input dimension of a `[..., out, in]` weight, plus what dgemma
reads from files and keeps as is. Codes, scales and byte layouts: docs/quantization.md, "Formats" and
"How the code is laid out".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

MODES = ("int8", "int4", "fp8", "nvfp4")
ZEROS = ("mid", "symmetric", "asymmetric")  # how int4 codes are read: q + 0.5, q, q - zero_point
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
NVFP4_GROUP = 16
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of the 8 codes (bit 3 is the sign)


@dataclass(frozen=True)
class QuantSpec:
    """How one module's weights are stored: the mode, the inputs per scale (None: one scale per row;
    nvfp4 is always 16), and for int4 how codes are read (`ZEROS`)."""

    mode: str
    group_size: int | None = None
    zero: str = "mid"

    def __post_init__(self):
        check_mode(self.mode)
        if self.zero not in ZEROS or (self.mode != "int4" and self.zero != "mid"):
            raise ValueError(f"zero={self.zero!r} is for int4 only, one of {ZEROS}")
        if self.mode == "nvfp4" and self.group_size != NVFP4_GROUP:
            raise ValueError(f"nvfp4 has one scale per {NVFP4_GROUP} inputs (got group_size={self.group_size})")
        if self.mode == "fp8" and self.group_size is not None:
            raise ValueError(f"fp8 has one scale per output row (got group_size={self.group_size})")

    @classmethod
    def of(cls, mode: str, group_size: int = 64, zero: str = "mid") -> QuantSpec:
        """dgemma's format for `mode` (`group_size` and `zero` are used by int4 only)."""
        group = group_size if mode == "int4" else NVFP4_GROUP if mode == "nvfp4" else None
        return cls(mode, group, zero if mode == "int4" else "mid")

    @property
    def writable(self) -> bool:
        """Whether dgemma quantizes into this spec (asymmetric int4 is read, never written)."""
        return self.zero != "asymmetric"

    def groups(self, n_in: int) -> int:
        """Scales per output row for a weight of `n_in` inputs."""
        return n_in // (self.group_size or n_in)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "group_size": self.group_size, "zero": self.zero}


@dataclass
class Quantized:
    """A quantized weight: `codes` and `scales` as stored, plus what is needed to read them back."""

    mode: str
    codes: torch.Tensor  # int8 [.., out, in] | uint8 [.., out, in/2] (int4, nvfp4) | float8_e4m3fn [.., out, in]
    scales: torch.Tensor  # fp32 [.., out, 1] (int8, fp8) | [.., out, in/group_size] (int4 bf16, nvfp4 e4m3)
    shape: tuple[int, ...]  # the original weight's shape
    group_size: int | None = None
    zero: str = "mid"  # int4: how codes are read (ZEROS)
    zero_point: torch.Tensor | None = None  # int4 "asymmetric": uint8 [.., out, groups], offset by 8 like the codes
    global_scale: torch.Tensor | None = None  # nvfp4: fp32 [.., out, 1]

    @property
    def nbytes(self) -> int:
        extra = [t.nbytes for t in (self.zero_point, self.global_scale) if t is not None]
        return self.codes.nbytes + self.scales.nbytes + sum(extra)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown quantization {mode!r}; choose one of {', '.join(MODES)}")
    if mode in ("fp8", "nvfp4") and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"{mode} needs a PyTorch with torch.float8_e4m3fn (2.1 or newer)")
    return mode


def _row_absmax(w: torch.Tensor) -> torch.Tensor:
    return w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)


def quantize(
    w: torch.Tensor, mode: str, group_size: int = 64, zero: str = "mid", amax: torch.Tensor | None = None
) -> Quantized:
    """Quantize a weight `[..., out, in]` (any float dtype; computed in fp32). int4 codes are read as
    q + 0.5 (`zero="mid"`, dgemma's own: 16 levels symmetric about 0) or as q ("symmetric", the
    compressed-tensors W4A16 layout that vLLM runs). `amax`: nvfp4's global scale from this max|w|
    instead of w's own (a fused group's, see quantize_nvfp4)."""
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
    if mode == "nvfp4":
        return quantize_nvfp4(w, amax)
    n_in = shape[-1]
    if group_size <= 0 or n_in % group_size or group_size % 2:
        raise ValueError(f"int4 group_size must be even and divide the input size {n_in} (got {group_size})")
    groups = w.reshape(*shape[:-1], n_in // group_size, group_size)
    # bf16 scales (0.03 bytes per weight at group 64, not 0.06), rounded before the codes are chosen
    scales = (groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 7.5).to(torch.bfloat16)
    if zero not in ("mid", "symmetric"):
        raise ValueError(f"int4 quantizes with zero 'mid' or 'symmetric' (got {zero!r})")
    offset = 0.5 if zero == "mid" else 0.0  # x = (q + 0.5) s, or x = q s
    codes = torch.round(groups / scales.float() - offset).clamp_(-8, 7).to(torch.int16)
    return Quantized(mode, pack_int4(codes.reshape(shape)), scales.squeeze(-1), shape, group_size, zero)


def quantize_nvfp4(w: torch.Tensor, amax: torch.Tensor | None = None) -> Quantized:
    """NVFP4 as compressed-tensors quantizes it (fp32 arithmetic in the same order, so the same bytes):
    global scale g = 448 * 6 / max|w| over the matrix, each 16-block's scale max|block| / 6 * g rounded
    to e4m3 (0 -> 0.125), codes the e2m1 values nearest w / (scale / g) with that library's ties.

    `amax` (a 2-D weight's) replaces max|w| in g: the max over the fused group the matrix belongs to
    (q / k / v, gate / up), so that the group shares one global scale, as llm-compressor writes it and
    as vLLM, which runs the group as one matmul with one global scale, needs it."""
    shape, n_in = tuple(w.shape), w.shape[-1]
    if n_in % NVFP4_GROUP:
        raise ValueError(f"nvfp4 needs the input size to be a multiple of {NVFP4_GROUP} (got {n_in})")
    w = w.float()
    lead = w.dim() - 2  # one global scale per matrix of a stack
    if amax is None:
        amax = w.abs().amax(dim=(-2, -1), keepdim=True)
    amax = amax.float().reshape(*shape[:lead], 1, 1).clamp_min(torch.finfo(torch.float32).tiny)
    g = torch.nan_to_num(FP8_MAX * FP4_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)
    blocks = w.reshape(*shape[:-1], n_in // NVFP4_GROUP, NVFP4_GROUP)
    scales = g.unsqueeze(-1) * (blocks.abs().amax(dim=-1, keepdim=True) / FP4_MAX)
    scales = scales.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    scales = torch.where(scales == 0, torch.full_like(scales, 0.125), scales)
    x = (blocks / (scales / g.unsqueeze(-1))).clamp(-FP4_MAX, FP4_MAX)
    a = x.abs()
    index = (a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0)
    codes = (index | (torch.signbit(x).to(torch.uint8) << 3)).reshape(shape)
    global_scale = g.expand(*shape[:lead], shape[-2], 1).contiguous()
    q = Quantized("nvfp4", pack_nibbles(codes), scales.squeeze(-1).to(torch.float8_e4m3fn), shape, NVFP4_GROUP)
    q.global_scale = global_scale
    return q


def quantized_buffers(w: torch.Tensor, spec: QuantSpec, amax: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A weight or a stack of them (`[E, out, in]`, quantized one matrix at a time so only one is ever
    in fp32) as the buffers a module stored as `spec` holds, by suffix: "" (codes), "_scale", and for
    nvfp4 "_global_scale" (from `amax`, a 2-D weight's fused group's max|w|, when given)."""
    args = (spec.mode, spec.group_size or w.shape[-1], spec.zero)
    parts = [quantize(w, *args, amax=amax)] if w.dim() == 2 else [quantize(m, *args) for m in w]
    out = {"": [q.codes for q in parts], "_scale": [q.scales for q in parts]}
    if spec.mode == "nvfp4":
        out["_global_scale"] = [q.global_scale for q in parts]
    return {k: v[0] if w.dim() == 2 else torch.stack(v) for k, v in out.items()}


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [..., n] -> two per byte, element 2k in the low nibble [..., ceil(n / 2)] (an odd
    last element pairs with a zero): the byte layout of dgemma's int4 and NVFP4 codes."""
    v = F.pad(values, (0, values.shape[-1] % 2))
    return v[..., 0::2] | (v[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [..., m] -> the nibbles' values 0..15, uint8 [..., 2m]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [-8, 7] (any int dtype, even last dimension) -> uint8, two per byte, low nibble first,
    each stored offset by 8 (0..15), so reading one back is `nibble - 8` with no sign handling."""
    return pack_nibbles((codes.to(torch.int16) + 8).to(torch.uint8))


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: uint8 [..., n/2] -> int8 codes in [-8, 7], [..., n]."""
    return unpack_nibbles(packed).to(torch.int8) - 8


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}
_NIBBLE_VALUES = {"mid": lambda n: n - 7.5, "symmetric": lambda n: n - 8.0, "asymmetric": lambda n: n}


def _byte_table(kind: str, device: torch.device) -> torch.Tensor:
    """byte -> the values of its (low, high) nibbles, fp32 [256, 2]: int4 codes read as `kind` (ZEROS;
    "asymmetric" gives the bare nibble, the zero point is subtracted per group), or "e2m1"."""
    if (kind, device) not in _TABLES:
        n = unpack_nibbles(torch.arange(256, dtype=torch.uint8, device=device)).view(256, 2).long()
        if kind == "e2m1":
            values = torch.tensor(E2M1, device=device)[n & 7] * torch.where(n >= 8, -1.0, 1.0)
        else:
            values = _NIBBLE_VALUES[kind](n.float())
        _TABLES[kind, device] = values.float()
    return _TABLES[kind, device]


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, rows: slice | None = None) -> torch.Tensor:
    """The weight (or only output `rows` of it, on the last-but-one dimension) in `dtype`: computed in
    fp32 and rounded once, so a 16-bit result equals compressed-tensors' decompression bit for bit."""
    pick = (lambda t: t) if rows is None else (lambda t: None if t is None else t[..., rows, :])
    codes, scales = pick(q.codes), pick(q.scales)
    if q.mode not in ("int4", "nvfp4"):
        if scales.shape[-1] == 1:  # one scale per row
            return (codes.float() * scales.float()).to(dtype)
        g = codes.shape[-1] // scales.shape[-1]  # int8 per group (GGUF Q8_0: 32)
        grouped = codes.float().view(*codes.shape[:-1], scales.shape[-1], g) * scales.float().unsqueeze(-1)
        return grouped.view(codes.shape).to(dtype)
    # one table lookup per byte gives both of its values (2x faster on CPU than shifting and masking)
    c = F.embedding(codes.int(), _byte_table("e2m1" if q.mode == "nvfp4" else q.zero, codes.device))
    g = q.group_size or q.shape[-1]
    c = c.view(*c.shape[:-2], c.shape[-2] // (g // 2), g)  # [..., out, groups, g]
    if q.mode == "nvfp4":  # e2m1 * (scale / global), as compressed-tensors orders it
        step = scales.float() / pick(q.global_scale)
    else:
        step = scales.float()
        if q.zero == "asymmetric":
            c = c - pick(q.zero_point).float().unsqueeze(-1)
    return (c * step.unsqueeze(-1)).view(*c.shape[:-2], -1).to(dtype)
