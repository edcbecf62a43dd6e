"""How big a configuration is, without building it: parameter counts (all, active per token, the vision
tower's), as `dgemma info` and the benchmarks report them."""

from __future__ import annotations

from .config import DiffusionGemmaConfig
from .vision import VisionConfig, count_vision_parameters


def count_parameters(config: DiffusionGemmaConfig) -> dict[str, int]:
    """Parameter counts computed from the config alone: total, active per text token (top-k experts only),
    and the vision tower's with its projection (part of the total; it runs once per image, not per token).

    The embedding is counted once (the LM head is tied to it). The self-conditioning block is part of the
    total and of the active count (it runs on every denoising step).
    """
    t = config.text_config
    h = t.hidden_size
    total = active = t.vocab_size * h + h  # embeddings + final norm
    sc = 3 * h * t.intermediate_size + h
    total += sc
    active += sc
    for spec in t.layers:
        q = t.num_attention_heads * spec.head_dim
        kv = spec.num_key_value_heads * spec.head_dim
        attn = h * q + h * kv * (2 if spec.has_v_proj else 1) + q * h + 2 * spec.head_dim
        dense = 3 * h * t.intermediate_size
        norms = 5 * h
        common = attn + dense + norms
        total += common
        active += common
        if t.has_experts:
            expert = 3 * h * t.moe_intermediate_size
            router = h * t.num_experts + h + t.num_experts
            total += t.num_experts * expert + router + 2 * h
            active += t.top_k_experts * expert + router + 2 * h
    vision = 0
    if config.vision_config is not None:
        vision = count_vision_parameters(VisionConfig.from_dict(config.vision_config), h)
    return {"total": total + vision, "active": active, "vision": vision}


def human_count(n: int) -> str:
    """12_345_678 -> '12.3M'."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    return f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)
