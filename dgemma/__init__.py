"""dgemma: an independent pure-PyTorch implementation of DiffusionGemma (not affiliated with Google).

import dgemma
model = dgemma.load("path/to/checkpoint")             # HF-format directory, safetensors
cache = model.new_cache(batch_size=1, max_length=512)
model.encode(prompt_ids, cache)                       # causal prefill, writes the cache
logits = model.denoise(canvas_ids, cache)             # one bidirectional denoising step
runner = dgemma.accelerate(model)                     # fast modules (+ CUDA graphs): pass it as the model
dgemma.generate(runner, prompt_ids)
"""

from . import images
from .ar import generate_ar, stream_ar
from .checkpoints.tokenizer import Tokenizer, chat_prompt
from .checkpoints.weights import load, save
from .generation.choose import choose, tool_call
from .generation.loop import GenerationResult
from .generation.programs import edit, fill, generate, generate_json, infill, stream
from .generation.sampling import SamplingParams
from .generation.session import Session
from .model.config import DiffusionGemmaConfig, GenerationConfig, TextConfig
from .model.kv_cache import KVCache
from .model.model import DiffusionGemma, EncodeOutput, build
from .model.presets import preset
from .model.sizes import count_parameters
from .runtime.runner import Runner, accelerate
from .tracing import Trace, trace

__version__ = "0.1.0"

__all__ = [
    "DiffusionGemma",
    "DiffusionGemmaConfig",
    "EncodeOutput",
    "GenerationConfig",
    "GenerationResult",
    "KVCache",
    "Runner",
    "SamplingParams",
    "Session",
    "TextConfig",
    "Tokenizer",
    "Trace",
    "__version__",
    "accelerate",
    "build",
    "chat_prompt",
    "choose",
    "count_parameters",
    "edit",
    "fill",
    "generate",
    "generate_ar",
    "generate_json",
    "images",
    "infill",
    "load",
    "preset",
    "save",
    "stream",
    "stream_ar",
    "tool_call",
    "trace",
]
