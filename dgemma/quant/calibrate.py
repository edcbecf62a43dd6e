"""Activation ranges for exports that quantize activations too (NVFP4 W4A4), calibrated on text.

`input_amax` runs a few batches of the user's text the way DiffusionGemma runs (prompt through the
encoder, a half-corrupted canvas denoised twice) and returns max|x| per Linear and per expert (experts no
token reached take their layer's largest): each export's `input_global_scale` = 448 x 6 / max|x|, for vLLM
(docs/quantization.md; dgemma/checkpoints/vllm_export.py). dgemma itself runs unquantized activations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..generation.sampling import random_tokens
from ..model.model import DiffusionGemma
from .modules import QuantExperts, QuantLinear


def calibration_batches(
    token_ids: list[int], *, batch_size: int, prompt_length: int, canvas_length: int, batches: int
) -> list[torch.Tensor]:
    """Up to `batches` batches [batch_size, prompt_length + canvas_length] cut in order from `token_ids`
    (the calibration text, tokenized); a ValueError when the text does not fill one."""
    width = prompt_length + canvas_length
    rows = len(token_ids) // width
    if rows < batch_size:
        raise ValueError(
            f"the calibration text has {len(token_ids)} tokens; one batch needs {batch_size * width} "
            f"({batch_size} samples of {prompt_length} prompt + {canvas_length} canvas tokens)"
        )
    ids = torch.tensor(token_ids[: rows * width]).reshape(rows, width)
    return [ids[i : i + batch_size] for i in range(0, rows - batch_size + 1, batch_size)][:batches]


@torch.no_grad()
def input_amax(
    model: DiffusionGemma, batches: Iterable[torch.Tensor], prompt_length: int, *, seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """max|x| of the inputs of every quantized Linear and expert of `model` over the calibration
    `batches` (see the module docstring), fp32 scalars by name; an expert no token reached takes its
    layer's largest (_fill_experts)."""
    amax: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        m = x.detach().abs().amax().float().cpu()
        amax[name] = torch.maximum(amax[name], m) if name in amax else m

    hooks, patched = [], []
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            hooks.append(module.register_forward_pre_hook(lambda _m, args, n=name: record(n, args[0])))
        elif isinstance(module, QuantExperts):
            patched.append(module)
            module.linear = _recording(module.linear, name, record)  # the instance's, undone below
    generator = torch.Generator().manual_seed(seed)
    try:
        for i, ids in enumerate(batches):
            ids = ids.to(model.device)
            cache = model.new_cache(ids.shape[0], ids.shape[1])
            model.encode(ids[:, :prompt_length], cache)
            canvas = ids[:, prompt_length:]
            noise = (torch.rand(canvas.shape, generator=generator) < 0.5).to(model.device)
            random = random_tokens(canvas.shape, model.text_config.vocab_size, "cpu", generator).to(model.device)
            canvas = torch.where(noise, random, canvas)
            logits = model.denoise(canvas, cache)
            model.denoise(canvas, cache, model.soft_embedding(logits))
            if progress:
                progress(i + 1)
    finally:
        for h in hooks:
            h.remove()
        for module in patched:
            del module.linear
    for name, module in model.named_modules():
        if isinstance(module, QuantExperts):
            amax |= _fill_experts(amax, name, module.shapes["gate_up_proj"][0])
    return amax


def _recording(linear, root: str, record):
    def wrapped(x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        record(f"{root}.{e}.{name}", x)
        return linear(x, name, e)

    return wrapped


def _fill_experts(amax: dict[str, torch.Tensor], root: str, num_experts: int) -> dict[str, torch.Tensor]:
    """Every expert's gate_up_proj / down_proj input range under `root`: its own, or, for an expert the
    calibration routed no token to, the largest of its layer's (a scale that cannot clip what the others
    saw)."""
    out = {}
    for which in ("gate_up_proj", "down_proj"):
        seen = [amax[k] for e in range(num_experts) if (k := f"{root}.{e}.{which}") in amax]
        if not seen:
            raise ValueError(f"the calibration routed no token to any expert of {root}")
        largest = torch.stack(seen).amax()
        out |= {f"{root}.{e}.{which}": amax.get(f"{root}.{e}.{which}", largest) for e in range(num_experts)}
    return out
