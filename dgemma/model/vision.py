"""The Gemma 4 vision tower and its projection into the text model: pixels -> soft tokens, read top to bottom.

    patches [N, P, 3*16*16] in [0, 1], positions [N, P, 2] = (x, y), (-1, -1) for padding rows
      -> 2p - 1, Linear, + position table[0][x] + table[1][y]               (patch_embedder)
      -> L bidirectional layers with 2-D RoPE, attention scale 1.0, sandwich norms (encoder)
      -> mean of each 3x3 cell of patches, times sqrt(H), in fp32; padding cells dropped (pooler)
      -> (h - std_bias) * std_scale (released tower only), cast to the model dtype
      -> weightless RMSNorm, Linear H -> text hidden size                     (embed_vision)

The soft tokens of every image, concatenated, replace the text embeddings at the image placeholder
positions of the prompt (no sqrt(hidden) scaling), and with `use_bidirectional_attention: "vision"` the
placeholders of one image see each other both ways on every layer of the causal encoder (kv_cache.py).
Parameter names are Hugging Face's under `model.encoder.` (the `.linear.` inside every projection too).
Preprocessing (images -> patches) is in images.py.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import check_types
from .layers import RMSNorm, gelu_tanh


@dataclass(slots=True)
class VisionConfig:
    """config.json's `vision_config` (model_type gemma4_vision): the fields the tower's shape depends on."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 16
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10240
    rope_theta: float = 100.0
    use_clipped_linears: bool = False
    standardize: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> VisionConfig:
        """Read a `vision_config` dict (transformers' defaults for missing fields); types and the features
        the tower has are checked, with errors naming the field."""
        where = f"{source} vision_config"
        if d.get("model_type", "gemma4_vision") != "gemma4_vision":
            raise ValueError(f"{where}: model_type {d.get('model_type')!r} is not gemma4_vision")
        if d.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"{where}: hidden_activation {d['hidden_activation']!r} is not gelu_pytorch_tanh")
        rope = d.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):  # transformers rewrites default to axial
            raise ValueError(f"{where}: rope_parameters.rope_type {rope['rope_type']!r} is not axial")
        kwargs = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        check_types(kwargs, typing.get_type_hints(cls), where)
        config = cls(**kwargs)
        if config.num_attention_heads % config.num_key_value_heads or config.head_dim % 4:
            raise ValueError(f"{where}: heads must group evenly and head_dim must be a multiple of 4")
        return config


# The released 26B-A4B's tower as Gemma 4's 26B/31B configs give it (shared/reference/vision.md section 1,
# inferred: read the checkpoint's own config.json when you have it): 569.5M parameters + 3.2M projection.
RELEASED_VISION_CONFIG = {
    "model_type": "gemma4_vision",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 72,
    "standardize": True,
}


class ClippableLinear(nn.Module):
    """A bias-free Linear kept under `.linear` (the checkpoint's name), optionally clamping its input and
    output to stored bounds (`use_clipped_linears`)."""

    def __init__(self, in_features: int, out_features: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.clipped = clipped
        if clipped:
            for name in ("input_min", "input_max", "output_min", "output_max"):
                bound = float("-inf") if name.endswith("min") else float("inf")
                self.register_buffer(name, torch.tensor(bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clipped:
            x = torch.clamp(x, self.input_min, self.input_max)
        y = self.linear(x)
        return torch.clamp(y, self.output_min, self.output_max) if self.clipped else y


class PatchEmbedder(nn.Module):
    """Patch pixels in [0, 1] -> 2p - 1 -> Linear, plus a learned embedding of the patch's column and row."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        m = config.hidden_size
        self.input_proj = nn.Linear(3 * config.patch_size**2, m, bias=False)
        self.position_embedding_table = nn.Parameter(torch.ones(2, config.position_embedding_size, m))

    def forward(self, pixels: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.input_proj((2 * (pixels - 0.5)).to(self.input_proj.weight.dtype))
        xy = positions.clamp(min=0)
        table = self.position_embedding_table
        where = F.embedding(xy[..., 0], table[0]) + F.embedding(xy[..., 1], table[1])
        return h + torch.where(padding[..., None], 0.0, where)  # padding rows get no position


def axial_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """2-D RoPE angles [N, P, D]: the first half of the head dim turns with x, the second with y."""
    quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float, device=positions.device)
    inv_freq = 1.0 / (theta ** (quarter / (head_dim // 2)))  # [D/4]
    freqs = positions[..., None].float() * inv_freq  # [N, P, 2, D/4]
    fx, fy = freqs[..., 0, :], freqs[..., 1, :]
    angles = torch.cat([fx, fx, fy, fy], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_axial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, P, H, D]: each half of the head dim rotated (rotate-half within the half) by its own angles."""

    def rotate(part: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        a, b = part.chunk(2, dim=-1)
        return part * c + torch.cat([-b, a], dim=-1) * s

    half = x.shape[-1] // 2
    c, s = cos[:, :, None], sin[:, :, None]
    return torch.cat(
        [rotate(x[..., :half], c[..., :half], s[..., :half]), rotate(x[..., half:], c[..., half:], s[..., half:])], -1
    )


class VisionAttention(nn.Module):
    """Bidirectional attention over one image's patches: q/k normed and rotated, v normed (no weight),
    scale 1.0 (the norms set the logits' scale), padding keys masked."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        m, h, kv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        clip = config.use_clipped_linears
        self.heads, self.kv_heads, self.head_dim = h, kv, d
        self.q_proj = ClippableLinear(m, h * d, clip)
        self.k_proj = ClippableLinear(m, kv * d, clip)
        self.v_proj = ClippableLinear(m, kv * d, clip)
        self.o_proj = ClippableLinear(h * d, m, clip)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.v_norm = RMSNorm(d, config.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos_sin, key_valid: torch.Tensor) -> torch.Tensor:
        n, p, _ = x.shape
        q = apply_axial_rope(self.q_norm(self.q_proj(x).view(n, p, self.heads, -1)), *cos_sin)
        k = apply_axial_rope(self.k_norm(self.k_proj(x).view(n, p, self.kv_heads, -1)), *cos_sin)
        v = self.v_norm(self.v_proj(x).view(n, p, self.kv_heads, -1))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=key_valid[:, None, None, :],
            scale=1.0,
            enable_gqa=self.heads != self.kv_heads,
        )
        return self.o_proj(out.transpose(1, 2).reshape(n, p, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        m, i, clip = config.hidden_size, config.intermediate_size, config.use_clipped_linears
        self.gate_proj = ClippableLinear(m, i, clip)
        self.up_proj = ClippableLinear(m, i, clip)
        self.down_proj = ClippableLinear(i, m, clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh(self.gate_proj(x)) * self.up_proj(x))


class VisionLayer(nn.Module):
    """Sandwich norms around attention and MLP; no layer scalar."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        m, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)
        self.input_layernorm = RMSNorm(m, eps)
        self.post_attention_layernorm = RMSNorm(m, eps)
        self.pre_feedforward_layernorm = RMSNorm(m, eps)
        self.post_feedforward_layernorm = RMSNorm(m, eps)

    def forward(self, x: torch.Tensor, cos_sin, key_valid: torch.Tensor) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, key_valid))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(config) for _ in range(config.num_hidden_layers))


def pool(h: torch.Tensor, positions: torch.Tensor, padding: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each kernel x kernel cell of patches averaged, times sqrt(H), in fp32 -> [soft tokens, H]: cells of
    every image in row-major order, images one after the other, cells no patch reaches dropped."""
    p, m = h.shape[1:]
    length = p // kernel**2
    h = h.masked_fill(padding[..., None], 0.0)
    if length != p:
        xy = positions.clamp(min=0)
        width = xy[..., 0].amax(dim=-1, keepdim=True) + 1
        cell = torch.div(xy, kernel, rounding_mode="floor")
        index = cell[..., 0] + (width // kernel) * cell[..., 1]  # [N, P]
        weights = F.one_hot(index.long(), length).float() / kernel**2  # [N, P, cells]
        h = (weights.transpose(1, 2) @ h.float()).to(h.dtype)
        kept = ~(weights == 0).all(dim=1)
    else:
        kept = ~padding
    return (h.float() * m**0.5)[kept]


class VisionTower(nn.Module):
    """Pixels (patchified, see images.py) -> fp32-scaled, standardized soft tokens [tokens, H]."""

    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = VisionEncoder(config)
        if config.standardize:
            self.register_buffer("std_bias", torch.zeros(config.hidden_size))
            self.register_buffer("std_scale", torch.ones(config.hidden_size))

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.config
        check_geometry(c, pixel_values, positions)
        padding = (positions == -1).all(dim=-1)
        h = self.patch_embedder(pixel_values, positions, padding)
        cos_sin = axial_cos_sin(positions, c.head_dim, c.rope_theta, h.dtype)
        for layer in self.encoder.layers:
            h = layer(h, cos_sin, ~padding)
        tokens = pool(h, positions, padding, c.pooling_kernel_size)
        if c.standardize:
            tokens = (tokens - self.std_bias.float()) * self.std_scale.float()
        return tokens.to(h.dtype)


def check_geometry(config: VisionConfig, values: torch.Tensor, positions: torch.Tensor) -> None:
    """Refuse Pixels cut for another tower (images.preprocess with another patch_size or pooling_kernel_size)
    before they meet its weights: a ValueError saying what they were cut for and what this tower takes."""
    p, k = config.patch_size, config.pooling_kernel_size
    takes = f"this model's vision tower takes patch_size {p} and pooling_kernel_size {k}"
    redo = "preprocess the images with images.geometry(model.config) (chat_prompt and text_prompt do)"
    if values.dim() != 3 or tuple(positions.shape) != (*values.shape[:2], 2):
        raise ValueError(
            f"pixels are values [images, patches, 3 * patch_size**2] and positions [images, patches, 2], not "
            f"{tuple(values.shape)} and {tuple(positions.shape)}"
        )
    width = values.shape[-1]
    if width != 3 * p * p:
        cut = math.isqrt(width // 3)
        was = f"patch_size {cut} ({width} values a patch)" if 3 * cut * cut == width else f"{width} values a patch"
        raise ValueError(f"the pixels were cut for {was}, but {takes} ({3 * p * p} values a patch): {redo}")
    rows, grids = values.shape[1], (positions.amax(dim=1) + 1).tolist()  # each image's patches across, down
    if rows % (k * k) or any(x % k or y % k for x, y in grids):
        fits = [n for n in range(2, 8) if not rows % (n * n) and all(not x % n and not y % n for x, y in grids)]
        was = "pooling_kernel_size " + " or ".join(map(str, fits)) if fits else "another pooling_kernel_size"
        shape = f"{rows} patch rows, grids of {grids[0][0]} x {grids[0][1]} patches"
        raise ValueError(f"the pixels were cut for {was} ({shape}: not in {k} x {k} pools), but {takes}: {redo}")


class VisionEmbedder(nn.Module):
    """Soft tokens -> the text model's embedding space: weightless RMSNorm, then a Linear."""

    def __init__(self, config: VisionConfig, text_hidden_size: int):
        super().__init__()
        self.embedding_pre_projection_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, with_scale=False)
        self.embedding_projection = nn.Linear(config.hidden_size, text_hidden_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding_projection(self.embedding_pre_projection_norm(tokens))


@dataclass
class Pixels:
    """Images as the tower takes them (images.py makes them): patches [N, P, 3*patch^2] in [0, 1] and their
    (x, y) positions [N, P, 2], (-1, -1) on padding rows; P is kernel^2 (9 in Gemma 4) x the images'
    soft-token budget."""

    values: torch.Tensor
    positions: torch.Tensor

    def to(self, device) -> Pixels:
        return Pixels(self.values.to(device), self.positions.to(device))

    @staticmethod
    def cat(groups: list[Pixels]) -> Pixels:
        """Images of several budgets as one batch, in order: each padded to the most patch rows (padding
        rows are masked and pooled away, so each image's soft tokens stay its own)."""
        widths = sorted({g.values.shape[-1] for g in groups})
        if len(widths) > 1:
            raise ValueError(f"images cut for different patch sizes ({widths} values a patch) cannot be batched")
        rows = max(g.values.shape[1] for g in groups)
        values = [F.pad(g.values, (0, 0, 0, rows - g.values.shape[1])) for g in groups]
        positions = [F.pad(g.positions, (0, 0, 0, rows - g.positions.shape[1]), value=-1) for g in groups]
        return Pixels(torch.cat(values), torch.cat(positions))


def image_blocks(is_image: torch.Tensor) -> torch.Tensor:
    """[B, T] bool (image placeholder or not) -> block ids [B, T]: each run of consecutive placeholders (one
    image) numbered 0, 1, ... within its row, -1 elsewhere."""
    previous = F.pad(is_image[:, :-1], (1, 0), value=False)
    starts = is_image & ~previous
    return torch.where(is_image, starts.long().cumsum(-1) - 1, -1)


def count_vision_parameters(config: VisionConfig, text_hidden_size: int) -> int:
    """Parameters of the tower and its projection into a text model of `text_hidden_size` (no weights made)."""
    m, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    layer = m * q + 2 * m * kv + q * m + 2 * d + 3 * m * i + 4 * m
    patches = 3 * config.patch_size**2 * m + 2 * config.position_embedding_size * m
    return patches + config.num_hidden_layers * layer + m * text_hidden_size
