"""Mixture-of-experts dispatch shared by the fast experts (dgemma/runtime/fast.py) and the quantized ones
(dgemma/quant/modules.py): the (token, slot) pairs sorted by expert, each expert run on its contiguous
rows, and the slots weighted in fp32 and summed. The reference loop is `model.Experts.forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def has_grouped_mm() -> bool:
    """Whether this PyTorch has the grouped matmul the grouped expert path needs."""
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[e-1]:offs[e] of `a` [R, K] times b[e] [K, N] for every group e -> [R, N]."""
    fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return fn(a, b, offs=offs)


def sort_by_expert(x: torch.Tensor, index: torch.Tensor, num_experts: int):
    """The (token, slot) pairs sorted by expert: (order of the pairs, rows per expert [E] int32 on the
    device, the tokens' rows in that order). Rows are counted by scatter-add, not bincount: bincount sizes
    its output from the data, a host sync."""
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return order, counts, x.index_select(0, order // index.shape[1])


def combine_slots(out: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, k: int, dtype) -> torch.Tensor:
    """Sorted fp32 expert outputs -> each token's K slots weighted in fp32 and summed, cast to `dtype`.

    The rows go back to (token, slot) order by a gather through the inverse permutation: on a CPU an
    index_select of whole rows is several times faster than the scatter `slots[order] = out`, and the
    slots are summed in the same order, so the result is the same bits."""
    out *= weights.reshape(-1).index_select(0, order)[:, None]
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return out.index_select(0, inverse).view(-1, k, out.shape[-1]).sum(dim=1).to(dtype)


def experts_by_expert(
    x: torch.Tensor,
    weights: torch.Tensor,
    index: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
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
