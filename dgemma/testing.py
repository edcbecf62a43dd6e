"""Small random checkpoints and tokenizers for tests and benchmarks (no downloads).

`make_oracle_checkpoint` builds a tiny `DiffusionGemmaForBlockDiffusion` with transformers (the
numerical oracle, a test dependency), gives every weight a non-trivial random value (norm weights,
router scales and the separate encoder/decoder layer scalars included, so each trap is exercised),
and saves it with `save_pretrained`. `make_tokenizer` trains a small byte-level BPE tokenizer with
Gemma 4-style special tokens and dgemma's chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|think|>",
                  "<|channel>", "<channel|>"]
TEMPLATE_PATH = Path(__file__).parent / "templates" / "gemma4_chat.jinja"

TINY_VISION = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=2, head_dim=16)


def tiny_text_kwargs(**overrides: Any) -> dict[str, Any]:
    """transformers DiffusionGemmaTextConfig arguments for a ~0.5M-parameter model (6 layers, 4 experts)."""
    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
              num_global_key_value_heads=1, sliding_window=16, num_experts=4, top_k_experts=2,
              moe_intermediate_size=32, max_position_embeddings=4096)
    kw.update(overrides)
    return kw


@torch.no_grad()
def randomize_oracle(model, seed: int = 0, dense: bool = False) -> None:
    """Give a transformers DiffusionGemma model non-trivial weights everywhere.

    With `dense`, every expert's down_proj is zero: the MoE branch then adds exactly zero, which makes the
    oracle equal to a dense-only dgemma model with the same other weights.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        elif name.endswith("per_expert_scale"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        else:  # norm weights and the router scale
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        if dense and "experts.down_proj" in name:
            p.zero_()
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))


def make_oracle_model(*, dense: bool = False, seed: int = 0, canvas_length: int = 8, **text_overrides: Any):
    """A randomised tiny transformers DiffusionGemmaForBlockDiffusion (fp32, eval mode)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig

    text = DiffusionGemmaTextConfig(**tiny_text_kwargs(**text_overrides))
    config = DiffusionGemmaConfig(text_config=text, vision_config=TINY_VISION, canvas_length=canvas_length)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    randomize_oracle(model, seed=seed, dense=dense)
    return model


def make_oracle_checkpoint(path: str | Path, **kwargs: Any):
    """Save a randomised tiny oracle model with `save_pretrained`; returns the oracle model."""
    model = make_oracle_model(**kwargs)
    model.save_pretrained(str(path))
    return model


def make_tokenizer(vocab_size: int = 512, corpus: list[str] | None = None):
    """A byte-level BPE `dgemma.Tokenizer` with Gemma 4-style specials (ids 0..9) and the dgemma template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from .tokenizer import Tokenizer

    if corpus is None:  # dgemma's own sources: always present, deterministic
        corpus = [p.read_text() for p in sorted(Path(__file__).parent.glob("*.py"))]
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>",
               "mask_token": "<mask>"}
    return Tokenizer(tok, special, TEMPLATE_PATH.read_text())
