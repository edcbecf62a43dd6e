"""Named configurations: the released 26B-A4B, and the small and tiny ones tests, benchmarks and the
shipped models are built from (`dgemma.preset(name)`, `dgemma info --preset`)."""

from __future__ import annotations

from .config import FULL, SLIDING, DiffusionGemmaConfig, TextConfig


def _preset_26b_a4b() -> DiffusionGemmaConfig:
    return DiffusionGemmaConfig(text_config=TextConfig(), canvas_length=256)


def _preset_tiny(dense: bool = False) -> DiffusionGemmaConfig:
    moe = (
        dict(num_experts=None, top_k_experts=None, moe_intermediate_size=None)
        if dense
        else dict(num_experts=4, top_k_experts=2, moe_intermediate_size=32)
    )
    text = TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=16,
        max_position_embeddings=4096,
        **moe,
    )
    return DiffusionGemmaConfig(
        text_config=text, canvas_length=8, boi_token_id=None, eoi_token_id=None, image_token_id=None
    )


def _preset_small() -> DiffusionGemmaConfig:
    text = TextConfig(
        vocab_size=32_768,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        global_head_dim=128,
        num_global_key_value_heads=1,
        sliding_window=512,
        max_position_embeddings=32_768,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=256,
        layer_types=([SLIDING] * 4 + [FULL]) * 2,
    )
    return DiffusionGemmaConfig(
        text_config=text, canvas_length=64, boi_token_id=None, eoi_token_id=None, image_token_id=None
    )


PRESETS = {
    "26b-a4b": _preset_26b_a4b,
    "small": _preset_small,
    "tiny": _preset_tiny,
    "tiny-dense": lambda: _preset_tiny(dense=True),
}


def preset(name: str) -> DiffusionGemmaConfig:
    """A named configuration: '26b-a4b' (the released model), 'small' (~70M), 'tiny', 'tiny-dense'."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]()
