"""Faster modules, swapped into a twin of the model that shares its weights (model.py stays the reference).

`fast_twin(model)` is a second DiffusionGemma over the very same parameters and buffers (no copy) whose
RMSNorms, LM head and experts (dense, sorted or grouped; quantized ones too) are the classes below; the
table in docs/speed.md ("The fast paths") says what each does and what it is tested against. A Runner runs
the twin, compiled or replayed from CUDA graphs; the model itself is never changed.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn.functional as F
from torch import nn

from ..generation.sampling import chunk_columns
from ..model.model import DiffusionGemma, Experts, LMHead, RMSNorm, gelu_tanh
from ..model.moe import combine_slots, experts_by_expert, grouped_mm, has_grouped_mm, sort_by_expert
from ..quant import QuantExperts, dequantize, use_kernels
from .cpu import int8_matmuls

# Run all experts densely when that adds fewer than this many multiply-adds over the routed computation.
DENSE_EXPERTS_MAX_EXTRA = 4_000_000


class FastRMSNorm(RMSNorm):
    """RMSNorm in one op where everything is fp32 (torch's fused `rms_norm`: the reference's arithmetic,
    the same bits on the CPUs measured, 4-5 us less per call, which counts where operations are small),
    else with fewer ops: rsqrt, and no casts when the input (or the weight) is fp32 already."""

    @classmethod
    def like(cls, norm: RMSNorm) -> FastRMSNorm:
        """A FastRMSNorm over `norm`'s own weight (shared, not copied)."""
        fast = cls(1, norm.eps, with_scale=False)
        fast.weight = norm.weight
        return fast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and (self.weight is None or self.weight.dtype == torch.float32):
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        h = x if x.dtype == torch.float32 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            h = h * (self.weight if self.weight.dtype == torch.float32 else self.weight.float())
        return h if h.dtype == x.dtype else h.to(x.dtype)


class FastLMHead(LMHead):
    """The LM head over vocabulary chunks: each chunk's product written straight into its columns of the
    logits (fp32 products need no temporary at all), then softcapped in place while it is in cache, as
    2c sigmoid(2x / c) - c: tanh's own identity, within 8e-6 of c tanh(x / c) at c = 30 (fp32 rounding of
    a sigmoid near 1/2, times 2c), at a tenth of the cost of torch's tanh on a CPU.

    On a CPU the chunks are [rows, ~1 MB] (cache-sized: the softcap's passes then cost little), and
    with the caller's `out` buffer no [B, T, V] tensor is allocated, whose fresh pages the kernel would
    otherwise fault in on every step; on a GPU the whole vocabulary is one chunk. With gradients enabled
    it is the reference computation."""

    @classmethod
    def like(cls, head: LMHead) -> FastLMHead:
        """A FastLMHead reading `head`'s config (shared, not copied)."""
        return cls(head.config)

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled():
            return super().forward(hidden, weight, out)
        v, m, cap = *weight.shape, self.softcap
        if out is None:
            out = torch.empty(*hidden.shape[:-1], v, dtype=torch.float32, device=hidden.device)
        h, flat = hidden.reshape(-1, m), out.view(-1, v)
        chunk = chunk_columns(max(1, h.shape[0]), v, h.device)  # the sampler pass's chunks: one budget
        for a in range(0, v, chunk):
            part = flat[:, a : a + chunk]
            if weight.dtype == torch.float32 and h.dtype == torch.float32:
                torch.mm(h, weight[a : a + chunk].t(), out=part)
            else:
                part.copy_(h @ weight[a : a + chunk].t())
            if cap is not None:  # c tanh(x / c) = 2c sigmoid(2x / c) - c: a CPU's sigmoid is ~10x its tanh
                part.mul_(2 / cap).sigmoid_().mul_(2 * cap).sub_(cap)
        return out


class FastExperts(Experts):
    """The stacked experts computed by size (dense, sorted) or, with `grouped`, as grouped matmuls."""

    def __init__(self, experts: Experts, grouped: bool = False):
        nn.Module.__init__(self)  # not Experts.__init__: the weights are `experts`' own, not new ones
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.grouped = grouped

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            return experts_grouped(self, x, weights, index)
        n, k = index.shape
        e, two_i, m = self.gate_up_proj.shape
        if (e - k) * n * 3 * m * (two_i // 2) <= DENSE_EXPERTS_MAX_EXTRA:
            return experts_dense(self, x, weights, index)
        return experts_sorted(self, x, weights, index)

    def extra_repr(self) -> str:
        e, two_i, m = self.gate_up_proj.shape
        return f"experts={e}, hidden={m}, intermediate={two_i // 2}, grouped={self.grouped}"


def experts_dense(self: Experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Every expert on every token; the routing weight is zero for experts a token did not choose."""
    e = self.gate_up_proj.shape[0]
    dense_w = weights.new_zeros(x.shape[0], e).scatter_(1, index, weights)  # [N, E] fp32
    gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I]
    y = torch.matmul(gelu_tanh(gate) * up, self.down_proj.transpose(1, 2))  # [E, N, M]
    return torch.einsum("enm,ne->nm", y.float(), dense_w).to(x.dtype)


def experts_sorted(self: Experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Token-expert pairs sorted by expert: one contiguous slice (and one weight read) per expert hit."""

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(gelu_tanh(gate) * up, self.down_proj[e])

    return experts_by_expert(x, weights, index, self.gate_up_proj.shape[0], expert)


def experts_grouped(self: Experts, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """All experts in two grouped matmuls over the (token, slot) pairs sorted by expert. Shapes depend only
    on the number of tokens, never on the routing, and nothing is read back to the host."""
    return grouped_experts(self.gate_up_proj, self.down_proj, x, weights, index)


def grouped_experts(
    gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor
) -> torch.Tensor:
    """experts_grouped on the stacks gate_up [E, 2I, M] and down [E, M, I]."""
    order, counts, xs = sort_by_expert(x, index, gate_up.shape[0])
    offs = counts.cumsum(0, dtype=torch.int32)  # where each expert's rows end
    gate, up = grouped_mm(xs, gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
    out = grouped_mm(gelu_tanh(gate) * up, down.transpose(1, 2), offs).float()
    return combine_slots(out, weights, order, index.shape[1], x.dtype)


class GroupedQuantExperts(QuantExperts):
    """Quantized experts (any mode) as grouped matmuls, with no host loop: each stack is dequantized
    whole into the activation dtype (one pass over its codes), then the two grouped matmuls of
    experts_grouped run on it. Capturable in a CUDA graph; the price is one dequantized copy of a layer's
    experts while the layer runs (1.5 GB in bf16 for the 26B-A4B model's 128 experts)."""

    @classmethod
    def like(cls, experts: QuantExperts) -> GroupedQuantExperts:
        """A GroupedQuantExperts over `experts`' own buffers (shared, not copied)."""
        fast = cls.__new__(cls)
        nn.Module.__init__(fast)
        fast.specs, fast.shapes, fast.kernel = experts.specs, experts.shapes, None
        for name, buffer in experts.named_buffers(recurse=False):
            fast.register_buffer(name, buffer)
        return fast

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        gate_up, down = (dequantize(self.quantized_stack(n), x.dtype) for n in ("gate_up_proj", "down_proj"))
        return grouped_experts(gate_up, down, x, weights, index)


def fast_twin(model: DiffusionGemma, *, grouped: bool | None = None) -> DiffusionGemma:
    """A DiffusionGemma sharing every parameter, buffer and config of `model`, with the fast modules.

    `grouped` (default: on CUDA when this PyTorch has grouped_mm) runs the experts as grouped matmuls.
    Make the twin after the model has its final device and dtype (moving a model replaces its buffers).
    """
    on_cuda = model.device.type == "cuda"
    grouped = (on_cuda and has_grouped_mm()) if grouped is None else grouped
    if grouped and not has_grouped_mm():
        raise RuntimeError("this PyTorch has no grouped_mm; use grouped=False or upgrade PyTorch")
    # deepcopy makes new modules, except what the memo already holds: the tensors and configs (shared)
    # and the modules to swap (their fast versions).
    shared = itertools.chain(model.parameters(), model.buffers(), (model.config, model.generation_config))
    memo = {id(obj): obj for obj in shared}
    memo[id(model.text_config)] = model.text_config
    for module in model.modules():
        if isinstance(module, RMSNorm):
            memo[id(module)] = FastRMSNorm.like(module)
        elif isinstance(module, LMHead):
            memo[id(module)] = FastLMHead.like(module)
        elif isinstance(module, Experts):
            memo[id(module)] = FastExperts(module, grouped)
        elif isinstance(module, QuantExperts) and grouped:
            memo[id(module)] = GroupedQuantExperts.like(module)
    twin = copy.deepcopy(model, memo)
    if on_cuda:
        use_kernels(twin)
    elif model.device.type == "cpu" and int8_matmuls():
        use_kernels(twin, modes=("int8",))  # W8A8 on the CPU's int8 dot products (BENCHMARKS.md: faster)
    return twin


def capturable(model: DiffusionGemma) -> bool:
    """Whether a denoising step of `model` can be captured in a CUDA graph: on CUDA, and no module that
    reads routing decisions back to the host (reference or quantized experts; grouped experts are fine)."""
    if model.device.type != "cuda":
        return False
    experts = (m for m in model.modules() if isinstance(m, Experts | QuantExperts))
    return all((isinstance(m, FastExperts) and m.grouped) or isinstance(m, GroupedQuantExperts) for m in experts)


def is_fast(model: nn.Module) -> bool:
    """Whether `model` holds fast modules (a twin made by fast_twin)."""
    return any(isinstance(m, FastRMSNorm | FastLMHead | FastExperts | GroupedQuantExperts) for m in model.modules())
