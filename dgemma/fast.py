"""Faster forward paths, applied to a model from outside (model.py stays the readable reference).

`accelerate(model)` swaps in:

- RMSNorm with fewer ops (rsqrt, and no casts when the input is already fp32);
- experts computed by size: when the extra work is small (few tokens, few experts), every expert runs on
  every token as two batched matmuls and unselected experts get weight zero, which replaces a Python loop
  of small ops; otherwise tokens are sorted by expert once and each expert reads its weights once, on a
  contiguous slice; on CUDA (or when asked) tokens are sorted the same way and every expert runs in one
  grouped matmul per projection (`torch.nn.functional.grouped_mm`): each expert's weights are read once
  per step, nothing waits for the device, and the step can be captured in a CUDA graph (dgemma/graphs.py);
- optionally `torch.compile` of the denoise and encode passes (`compile=True`): fused kernels and no
  Python overhead per op, after a one-off compile (seconds with a warm cache, about a minute cold).

Results match the reference to float rounding (tests compare them); `restore(model)` undoes everything.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .model import DiffusionGemma, Experts, RMSNorm, gelu_tanh

# Run all experts densely when that adds fewer than this many multiply-adds over the routed computation.
DENSE_EXPERTS_MAX_EXTRA = 4_000_000


def _rms_norm(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    h = x if x.dtype == torch.float32 else x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    if self.weight is not None:
        h = h * (self.weight if self.weight.dtype == torch.float32 else self.weight.float())
    return h if h.dtype == x.dtype else h.to(x.dtype)


def has_grouped_mm() -> bool:
    """Whether this PyTorch has the grouped matmul the grouped expert path needs."""
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of `a` [R, K] times b[e] [K, N] for every group e -> [R, N]."""
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def _experts(self: Experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if getattr(self, "grouped", False):
        return experts_grouped(self, x, weights, index)
    n, k = index.shape
    e, two_i, m = self.gate_up_proj.shape
    if (e - k) * n * 3 * m * (two_i // 2) <= DENSE_EXPERTS_MAX_EXTRA:
        return _experts_dense(self, x, weights, index)
    return _experts_sorted(self, x, weights, index)


def _experts_dense(self: Experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Every expert on every token; the routing weight is zero for experts a token did not choose."""
    e = self.gate_up_proj.shape[0]
    dense_w = weights.new_zeros(x.shape[0], e).scatter_(1, index, weights)  # [N, E] fp32
    gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I]
    y = torch.matmul(gelu_tanh(gate) * up, self.down_proj.transpose(1, 2))  # [E, N, M]
    return torch.einsum("enm,ne->nm", y.float(), dense_w).to(x.dtype)


def _experts_sorted(self: Experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Token-expert pairs sorted by expert: one contiguous slice (and one weight read) per expert hit."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(gelu_tanh(gate) * up, self.down_proj[e])

    return experts_by_expert(x, weights, index, self.gate_up_proj.shape[0], expert)


def sort_by_expert(x: torch.Tensor, index: torch.Tensor, num_experts: int):
    """The (token, slot) pairs sorted by expert: (order of the pairs, rows per expert [E] int32 on the
    device, the tokens' rows in that order). Rows are counted by scatter-add, not bincount: bincount sizes
    its output from the data, a host sync."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts, x[order // index.shape[1]]


def combine_slots(out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, k: int, dtype) -> torch.Tensor:
    """Sorted fp32 expert outputs -> each token's K slots weighted in fp32 and summed, cast to `dtype`."""
    out *= weights.reshape(-1)[order, None]
    slots = torch.empty_like(out)
    slots[order] = out
    return slots.view(-1, k, out.shape[-1]).sum(dim=1).to(dtype)


def experts_grouped(self: Experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """All experts in two grouped matmuls over the (token, slot) pairs sorted by expert. Shapes depend only
    on the number of tokens, never on the routing, and nothing is read back to the host."""
    order, counts, xs = sort_by_expert(x, index, self.gate_up_proj.shape[0])
    offs = counts.cumsum(0, dtype=torch.int32)  # where each expert's rows end
    gate, up = grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs).chunk(2, dim=-1)
    out = grouped_mm(gelu_tanh(gate) * up, self.down_proj.transpose(1, 2), offs).float()
    return combine_slots(out, weights, order, index.shape[1], x.dtype)


def experts_by_expert(
    x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, num_experts: int, expert
) -> torch.Tensor:
    """The MoE block's dispatch: sort the (token, slot) pairs by expert, run `expert(e, rows)` once per
    expert hit on its contiguous rows, weight each output in fp32 and sum a token's K slots."""
    order, counts, xs = sort_by_expert(x, index, num_experts)
    out = torch.empty(xs.shape[0], x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for e, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = slice(start, start + count)
        out[rows] = expert(e, xs[rows]).float()
        start += count
    return combine_slots(out, weights, order, index.shape[1], x.dtype)


def accelerate(
    model: DiffusionGemma, *, compile: bool = False, grouped: bool | None = None, graphs: bool | None = None
) -> DiffusionGemma:
    """Install the fast paths on `model` (in place; returns it). Idempotent.

    `grouped` (default: on CUDA when available) runs the experts as grouped matmuls; `graphs` (default: on
    CUDA) replays each canvas-sized denoising step from a captured CUDA graph (dgemma/graphs.py).
    """
    on_cuda = model.device.type == "cuda"
    grouped = (on_cuda and has_grouped_mm()) if grouped is None else grouped
    if grouped and not has_grouped_mm():
        raise RuntimeError("this PyTorch has no grouped_mm; accelerate(grouped=False) or upgrade PyTorch")
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(_rms_norm, module)
        elif isinstance(module, Experts):
            module.grouped = grouped
            module.forward = types.MethodType(_experts, module)
    if on_cuda:  # int8 / fp8 weights: tensor-core matmuls (see dgemma/quant/kernels.py)
        from .quant import use_kernels

        use_kernels(model)
    if compile and "denoise" not in model.__dict__:
        # Experts that loop over a data-dependent split break the graph once per layer; allow one
        # compiled variant per layer instead of falling back to eager after the default 8.
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, 4 * model.text_config.num_hidden_layers
        )
        model.denoise = torch.compile(model.denoise)
    elif (capturable(model) if graphs is None else graphs) and "denoise" not in model.__dict__:
        from .graphs import GraphedDenoise

        model.denoise = GraphedDenoise(model)
    return model


def capturable(model: DiffusionGemma) -> bool:
    """Whether a denoising step of `model` can be captured in a CUDA graph: on CUDA, and no module that
    reads routing decisions back to the host (reference or quantized experts; grouped experts are fine)."""
    from .quant.modules import QuantExperts

    if model.device.type != "cuda":
        return False
    return all(getattr(m, "grouped", False) for m in model.modules() if isinstance(m, Experts | QuantExperts))


def restore(model: DiffusionGemma) -> DiffusionGemma:
    """Remove what `accelerate` installed: the reference forward paths again."""
    for module in model.modules():
        module.__dict__.pop("forward", None)
        module.__dict__.pop("grouped", None)
        if getattr(module, "kernel", None):
            module.kernel = None
    denoise = model.__dict__.pop("denoise", None)
    if hasattr(denoise, "release"):
        denoise.release()
    return model


def is_accelerated(model: DiffusionGemma) -> bool:
    return any("forward" in m.__dict__ for m in model.modules())
