"""peft LoRA layers for what peft does not know: quantized linears and the stacked experts.

`QuantLoraLinear`, `LoraExperts` and `SharedLoraExperts`, registered with peft's custom-module mechanism.
Details, merging included: docs/training.md, "LoRA layers for quantized linears and experts"; memory and
correctness: docs/qlora.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from ..model.model import Experts, gelu_tanh
from ..model.moe import experts_by_expert
from ..quant import QuantExperts, QuantLinear, dequantize
from .config import EXPERT_KINDS


def _move_to(layer: nn.Module, adapter_name: str, device: torch.device) -> None:
    """Put one adapter on the base's device, keeping its dtype (the base's codes may be uint8 or fp8)."""
    for name in ("lora_A", "lora_B", "lora_dropout"):
        table = getattr(layer, name)
        if adapter_name in table:
            table[adapter_name] = table[adapter_name].to(device)


class QuantLoraLinear(PeftLoraLinear):
    """peft's LoRA Linear over a QuantLinear: the forward is peft's (base output + B A x * scaling)."""

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: torch.device | None = None) -> None:
        _move_to(self, adapter_name, device or self.get_base_layer().weight.device)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the adapters' deltas to the dequantized weight and quantize it again (same format)."""
        base: QuantLinear = self.get_base_layer()
        for name in adapter_names or self.active_adapters:
            if name in self.lora_A and name not in self.merged_adapters:
                w = dequantize(base.quantized()) + self.get_delta_weight(name).float()
                if safe_merge and not torch.isfinite(w).all():
                    raise ValueError(f"merging adapter {name!r} gives non-finite weights")
                base.set_weight(w)
                self.merged_adapters.append(name)

    def unmerge(self) -> None:
        raise ValueError("an adapter merged into a quantized weight cannot be unmerged (it was re-quantized)")


class ExpertFactors(nn.Module):
    """One factor of the experts' adapters: a parameter per expert weight, [G, rows, cols]."""

    def __init__(self, shapes: dict[str, tuple[int, int, int]], device: torch.device, zeros: bool):
        super().__init__()
        for name, shape in shapes.items():
            p = nn.Parameter(torch.zeros(shape, device=device))
            if not zeros:  # as peft initialises lora_A: kaiming-uniform with a = sqrt(5), fan_in = cols
                bound = 1 / math.sqrt(shape[-1])
                nn.init.uniform_(p, -bound, bound)
            self.register_parameter(name, p)


class LoraExperts(nn.Module, LoraLayer):
    """LoRA on stacked experts: expert e's gate_up_proj and down_proj outputs gain B_e A_e x * scaling
    (one pair of factors per expert; `SharedLoraExperts`: one pair for all)."""

    per_expert = True

    def __init__(self, base_layer: nn.Module, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        m = module.shapes["gate_up_proj"][2]
        return m, m

    def update_layer(self, adapter_name: str, r: int, lora_alpha: int, config, **kwargs) -> None:
        if r <= 0:
            raise ValueError(f"LoRA rank must be > 0 (got {r})")
        base = self.get_base_layer()  # Experts or QuantExperts: the same per-expert interface
        shapes = base.shapes
        groups = shapes["gate_up_proj"][0] if self.per_expert else 1
        device = base.gate_up_proj.device  # the parameter, or the codes
        self.r[adapter_name], self.lora_alpha[adapter_name] = r, lora_alpha
        self.scaling[adapter_name] = lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        p = config.lora_dropout
        self.lora_dropout[adapter_name] = nn.Dropout(p) if p > 0 else nn.Identity()
        a = {n: (groups, r, s[2]) for n, s in shapes.items()}
        b = {n: (groups, s[1], r) for n, s in shapes.items()}
        self.lora_A[adapter_name] = ExpertFactors(a, device, zeros=False)
        self.lora_B[adapter_name] = ExpertFactors(b, device, zeros=True)
        self.set_adapter(self.active_adapters)

    def _delta(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        g = e if self.per_expert else 0
        out = None
        for adapter in self.active_adapters:
            if adapter not in self.lora_A:
                continue
            a, b = getattr(self.lora_A[adapter], name)[g], getattr(self.lora_B[adapter], name)[g]
            h = F.linear(F.linear(self.lora_dropout[adapter](x.to(a.dtype)), a), b) * self.scaling[adapter]
            out = h if out is None else out + h
        return out

    def _linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        y = self.get_base_layer().linear(x, name, e)
        delta = self._delta(x, name, e)
        return y if delta is None else y + delta.to(y.dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        base = self.get_base_layer()
        if self.disable_adapters or self.merged:
            return base(x, weights, index)

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = self._linear(rows, "gate_up_proj", e).chunk(2, dim=-1)
            return self._linear(gelu_tanh(gate) * up, "down_proj", e)

        return experts_by_expert(x, weights, index, base.shapes["gate_up_proj"][0], expert)

    def get_delta_weight(self, adapter: str, name: str, e: int) -> torch.Tensor:
        """Expert e's weight change [out, in] from `adapter`, in fp32."""
        g = e if self.per_expert else 0
        a, b = getattr(self.lora_A[adapter], name)[g], getattr(self.lora_B[adapter], name)[g]
        return (b.float() @ a.float()) * self.scaling[adapter]

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the deltas into every expert (a quantized base: dequantized, added, quantized again)."""
        base = self.get_base_layer()
        for adapter in adapter_names or self.active_adapters:
            if adapter not in self.lora_A or adapter in self.merged_adapters:
                continue
            for name, (e_count, _, _) in base.shapes.items():
                for e in range(e_count):  # a quantized base: dequantized, added, quantized again
                    base.set_expert(
                        name, e, base.expert(name, e, torch.float32) + self.get_delta_weight(adapter, name, e)
                    )
            self.merged_adapters.append(adapter)

    def unmerge(self) -> None:
        raise ValueError("unmerging expert adapters is not supported; reload the base checkpoint instead")


class SharedLoraExperts(LoraExperts):
    """LoRA on stacked experts with one pair of factors shared by every expert."""

    per_expert = False


def custom_modules(experts: str = "per_expert") -> dict[type[nn.Module], type[nn.Module]]:
    """The peft custom-module mapping for dgemma's modules; `experts` picks the experts' adapter kind."""
    if experts not in EXPERT_KINDS:
        raise ValueError(f"lora.experts must be one of {EXPERT_KINDS} (got {experts!r})")
    kind = LoraExperts if experts == "per_expert" else SharedLoraExperts
    return {QuantLinear: QuantLoraLinear, QuantExperts: kind, Experts: kind}
