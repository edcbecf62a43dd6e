"""Where dgemma's parameters live in a transformers DiffusionGemma checkpoint: the name mapping every
reader and writer shares (safetensors, compressed-tensors, GGUF).

The decoder's language model is stored under `model.decoder.`, its tied encoder copy under
`model.encoder.language_model.` (only the encoder's layer scalars differ), the vision tower and its
projection under `model.encoder.`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

DEC = "model.decoder."
ENC = "model.encoder.language_model."
VISION_ROOT = "model.encoder."
VISION = (VISION_ROOT + "vision_tower.", VISION_ROOT + "embed_vision.")
_ENC_SCALAR = re.compile(r"^layers\.(\d+)\.encoder_layer_scalar$")


def hf_name(ours: str) -> str:
    """The checkpoint's name of one of our parameter names (encoder scalars live under the encoder)."""
    if ours.startswith(("vision_tower.", "embed_vision.")):
        return VISION_ROOT + ours
    m = _ENC_SCALAR.match(ours)
    return f"{ENC}layers.{m.group(1)}.layer_scalar" if m else DEC + ours


def hf_state_dict(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under transformers' checkpoint names (each tied tensor once)."""
    for name, t in model.state_dict().items():
        yield hf_name(name), t
