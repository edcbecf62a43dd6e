"""Typed configuration for DiffusionGemma, read from (and written back to) a checkpoint's JSON files.

Field names are those of the Hugging Face `config.json` (the nested `text_config` of
`model_type: diffusion_gemma`) and `generation_config.json`, so a checkpoint maps onto these classes
one to one. Per-layer values (attention type, head dim, KV heads, RoPE) are derived here, once, and the
model reads them from `TextConfig.layer(i)`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import types
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..generation.sampling import validate

SLIDING = "sliding_attention"
FULL = "full_attention"
_LAYER_TYPES = (SLIDING, FULL)
_ROPE_TYPES = ("default", "proportional")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


# Keys of the official file formats that dgemma reads nothing from: accepted silently. Any other unknown key
# is a warning, or an error when it is a close misspelling of a key dgemma reads that the file leaves out.
# fmt: off
_PRETRAINED_KEYS = frozenset([  # every transformers config.json has these
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "use_cache",
])
_CONFIG_KEYS_UNUSED = _PRETRAINED_KEYS | frozenset([
    # Gemma 4's audio / video ids and blocks, token ids transformers copies to the top, quantization blocks
    "initializer_range", "audio_config", "video_token_id", "boa_token_id", "eoa_token_id", "eoa_token_index",
    "audio_token_id", "vision_soft_tokens_per_image", "pad_token_id", "bos_token_id", "eos_token_id",
    "quantization", "quantization_config",
])
_TEXT_KEYS_UNUSED = _PRETRAINED_KEYS | frozenset([
    # Gemma 4 text keys that do not change DiffusionGemma's computation (dropout is training-only)
    "model_type", "tie_word_embeddings", "attention_dropout", "vocab_size_per_layer_input", "enable_moe_block",
    "use_double_wide_mlp",
])
# fmt: on
_TEXT_KEYS_READ = ("per_layer_config",)
_TEXT_KEYS_REFUSED = ("hidden_size_per_layer_input", "num_kv_shared_layers")  # E2B/E4B features, refused if set
# transformers' generation_config.json carries dozens of autoregressive sampling keys that DiffusionGemma's
# sampler does not use: unknown keys there pass silently, except close misspellings of dgemma's own keys
# (these two of transformers' keys look like misspellings of ours, and are not).
_GENERATION_LOOKALIKES = frozenset(["min_new_tokens", "assistant_confidence_threshold"])


def _describe_type(hint) -> str:
    """A field's type in JSON words: int | None -> 'an integer or null'."""
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        return " or ".join(_describe_type(h) for h in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        return "a list of " + {int: "integers", str: "strings"}.get(typing.get_args(hint)[0], "values")
    if typing.get_origin(hint) is dict or hint is dict:
        return "an object"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(hint, "a value")


def _has_type(value, hint) -> bool:
    """Whether a value read from JSON fits a field's type hint (an int is a float; a bool is not an int)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (types.UnionType, typing.Union):
        return any(_has_type(value, h) for h in args)
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, args[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict) and (not args or all(_has_type(v, args[1]) for v in value.values()))
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def check_types(d: dict[str, Any], hints: dict[str, Any], source: str) -> None:
    """Raise a ValueError naming the file, the key, the expected type and the value of each ill-typed key."""
    errors = [
        f"{key} must be {_describe_type(hint)} (got {d[key]!r})"
        for key, hint in hints.items()
        if key in d and not _has_type(d[key], hint)
    ]
    if errors:
        raise ValueError(f"{source}: " + "; ".join(errors))


def _check_keys(d: dict[str, Any], read: list[str], unused: frozenset[str], source: str, warn: bool = True) -> None:
    """Refuse a key that is a close misspelling of a key `read` that the file leaves out; warn about the
    other keys dgemma does not read (silent for the `unused` keys of the official format)."""
    unknown = sorted(set(d) - set(read) - unused)
    missing = [k for k in read if k not in d]
    for key in unknown:
        close = difflib.get_close_matches(key, missing, n=1, cutoff=0.8)  # one typo in a 10-letter key: 0.95
        if close:
            raise ValueError(f"unknown key {key!r} in {source}; did you mean {close[0]!r}?")
    if unknown and warn:
        warnings.warn(f"{source}: dgemma does not read {', '.join(map(repr, unknown))}; ignored", stacklevel=3)


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e}") from e
    if not isinstance(d, dict):
        raise ValueError(f"{path} must hold a JSON object (got {type(d).__name__})")
    return d


def _default_rope_parameters() -> dict[str, dict[str, Any]]:
    return {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }


# The text fields of a model adapted from an autoregressive Gemma, at DiffusionGemma's values: left out of
# config.json there (attention_k_eq_v, a transformers key, is always written)
_ADAPTED_DEFAULTS = {"query_pre_attn_scalar": None, "use_value_norm": True, "mlp_post_norm": True}


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Everything that differs between layers, resolved for one layer index."""

    layer_type: str  # SLIDING or FULL
    head_dim: int
    num_key_value_heads: int
    rope_type: str  # "default" or "proportional"
    rope_theta: float
    partial_rotary_factor: float
    sliding_window: int | None  # None on full-attention layers
    k_eq_v: bool = True  # full layers' values are their keys (Gemma 4); False: a v_proj of their own

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING

    @property
    def has_v_proj(self) -> bool:
        """Global layers have no v_proj: their values are the raw k_proj output (K = V), unless k_eq_v is off."""
        return self.is_sliding or not self.k_eq_v


@dataclass(slots=True)
class TextConfig:
    """The text stack (`text_config` in config.json). Defaults are those of the 26B-A4B model."""

    vocab_size: int = 262_144
    hidden_size: int = 2816
    intermediate_size: int = 2112
    num_hidden_layers: int = 30
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = 2
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 262_144
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    rope_parameters: dict[str, dict[str, Any]] = field(default_factory=_default_rope_parameters)
    attention_bias: bool = False
    sliding_window: int = 1024
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = 30.0
    num_experts: int | None = 128
    top_k_experts: int | None = 8
    moe_intermediate_size: int | None = 704
    initializer_range: float = 0.02
    # "vision": the tokens of one image attend to each other both ways, on every layer (see vision.py)
    use_bidirectional_attention: str | None = None
    # What a model adapted from an autoregressive Gemma needs (dgemma/checkpoints/from_ar.py); the defaults
    # are DiffusionGemma's, so a released checkpoint never sets them. Gemma 3: attention scores scaled by
    # query_pre_attn_scalar ** -0.5 (None: 1.0, Gemma 4), no value norm, values of their own on full layers;
    # Gemma 3 and Gemma 4 dense layers: the MLP's output normed once (post_feedforward_layernorm), not first
    # by post_feedforward_layernorm_1 as in the MoE layer.
    query_pre_attn_scalar: float | None = None
    use_value_norm: bool = True
    attention_k_eq_v: bool = True
    mlp_post_norm: bool = True

    def __post_init__(self) -> None:
        if self.layer_types is None:
            # Gemma 4's pattern: five sliding-window layers, then one global layer.
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if self.layer_types and self.layer_types[-1] != FULL and self.use_value_norm:
            # The reference forces this too (with a warning); doing the same keeps numerics identical. A
            # Gemma 3 stack (no value norm) keeps its pattern: Gemma 3 1B ends on a sliding layer.
            warnings.warn(
                "the last layer must use full attention; forcing layer_types[-1] = 'full_attention'", stacklevel=2
            )
            self.layer_types[-1] = FULL
        self.validate()

    # ----------------------------------------------------------------------------------------------
    @property
    def has_experts(self) -> bool:
        """False for dense-only configs (no router, no experts)."""
        return bool(self.num_experts)

    def layer(self, i: int) -> LayerSpec:
        """The resolved per-layer values of layer `i`."""
        layer_type = self.layer_types[i]
        rope = self.rope_parameters[layer_type]
        is_full = layer_type == FULL
        num_kv = self.num_key_value_heads
        if is_full and self.num_global_key_value_heads is not None:
            num_kv = self.num_global_key_value_heads
        return LayerSpec(
            layer_type=layer_type,
            head_dim=self.global_head_dim if is_full else self.head_dim,
            num_key_value_heads=num_kv,
            rope_type=rope.get("rope_type", "default"),
            rope_theta=float(rope["rope_theta"]),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 1.0)),
            sliding_window=None if is_full else self.sliding_window,
            k_eq_v=self.attention_k_eq_v,
        )

    @property
    def layers(self) -> list[LayerSpec]:
        return [self.layer(i) for i in range(self.num_hidden_layers)]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    # ----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming every field that cannot describe a model dgemma can build."""
        errors: list[str] = []
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "global_head_dim",
            "sliding_window",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                errors.append(f"{name} must be a positive integer (got {value!r})")
        if errors:
            raise ValueError("invalid text_config: " + "; ".join(errors))
        if len(self.layer_types) != self.num_hidden_layers:
            errors.append(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad_types = sorted(set(self.layer_types) - set(_LAYER_TYPES))
        if bad_types:
            errors.append(f"layer_types may only contain {_LAYER_TYPES} (got {bad_types})")
        errors += self._rope_errors()
        errors += self._head_errors()
        moe = (self.num_experts, self.top_k_experts, self.moe_intermediate_size)
        if any(moe) and not all(isinstance(v, int) and v > 0 for v in moe):
            errors.append(
                "num_experts, top_k_experts and moe_intermediate_size must all be positive "
                f"integers, or all unset for a dense-only model (got {moe})"
            )
        elif all(moe) and self.top_k_experts > self.num_experts:
            errors.append(f"top_k_experts ({self.top_k_experts}) exceeds num_experts ({self.num_experts})")
        if self.hidden_activation not in _ACTIVATIONS:
            errors.append(f"hidden_activation must be one of {_ACTIVATIONS} (got {self.hidden_activation!r})")
        if self.rms_norm_eps <= 0:
            errors.append(f"rms_norm_eps must be > 0 (got {self.rms_norm_eps})")
        if self.use_bidirectional_attention not in (None, "vision"):
            errors.append(
                f"use_bidirectional_attention must be null or 'vision' (got {self.use_bidirectional_attention!r})"
            )
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            errors.append(f"final_logit_softcapping must be > 0 or null (got {self.final_logit_softcapping})")
        for name in ("pad_token_id", "bos_token_id"):
            tok = getattr(self, name)
            if tok is not None and not 0 <= tok < self.vocab_size:
                errors.append(f"{name} {tok} is outside the vocabulary (size {self.vocab_size})")
        for tok in self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                errors.append(f"eos_token_id {tok} is outside the vocabulary (size {self.vocab_size})")
        if errors:
            raise ValueError("invalid text_config: " + "; ".join(errors))

    def _head_errors(self) -> list[str]:
        """What is wrong with the attention heads' sizes."""
        errors: list[str] = []
        for name, dim in (("head_dim", self.head_dim), ("global_head_dim", self.global_head_dim)):
            if dim % 2:
                errors.append(f"{name} must be even for RoPE (got {dim})")
        for name, kv in (
            ("num_key_value_heads", self.num_key_value_heads),
            ("num_global_key_value_heads", self.num_global_key_value_heads),
        ):
            if kv is not None and (kv <= 0 or self.num_attention_heads % kv):
                errors.append(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of {name} ({kv})")
        return errors

    def _rope_errors(self) -> list[str]:
        """What is wrong with rope_parameters, per layer type used."""
        errors = []
        for layer_type in set(self.layer_types) & set(_LAYER_TYPES):
            rope = self.rope_parameters.get(layer_type)
            if not isinstance(rope, dict) or "rope_theta" not in rope:
                errors.append(f"rope_parameters[{layer_type!r}] must be a dict with rope_theta")
            elif rope.get("rope_type", "default") not in _ROPE_TYPES:
                errors.append(
                    f"rope_parameters[{layer_type!r}].rope_type must be one of {_ROPE_TYPES} "
                    f"(got {rope.get('rope_type')!r})"
                )
            elif rope.get("rope_type", "default") == "default" and rope.get("partial_rotary_factor", 1.0) != 1.0:
                errors.append(f"rope_parameters[{layer_type!r}]: partial_rotary_factor needs rope_type 'proportional'")
        return errors

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> TextConfig:
        """Build from a config.json `text_config` dict: every value's type is checked, a misspelt key is
        refused, other unknown keys are a warning, unsupported features are refused. `source` names the
        file in errors."""
        d = copy.deepcopy(d)
        where = f"{source} text_config"
        names = [f.name for f in dataclasses.fields(cls)]
        _check_keys(d, [*names, *_TEXT_KEYS_READ, *_TEXT_KEYS_REFUSED], _TEXT_KEYS_UNUSED, where)
        hints = {
            **typing.get_type_hints(cls),
            "rope_parameters": dict[str, dict[str, Any]] | None,
            "per_layer_config": dict | None,
        }
        if d.get("attention_k_eq_v", False) is None:  # null: transformers' default (True here)
            del d["attention_k_eq_v"]
        check_types(d, hints, where)
        for name, rope in (d.get("rope_parameters") or {}).items():
            rope_hints = {"rope_type": str, "rope_theta": float, "partial_rotary_factor": float}
            check_types(rope, rope_hints, f"{where} rope_parameters[{name!r}]")
        bidir = d.get("use_bidirectional_attention")
        if bidir == "all":
            raise ValueError(
                "text_config.use_bidirectional_attention='all' (a bidirectional encoder) is not a "
                "DiffusionGemma configuration; its encoder is causal"
            )
        if d.get("hidden_size_per_layer_input") or d.get("num_kv_shared_layers"):
            raise ValueError(
                "per-layer input embeddings and shared-KV layers (Gemma 4 E2B/E4B features) are not "
                "part of DiffusionGemma"
            )
        kwargs = {k: v for k, v in d.items() if k in names}
        layer_types = d.get("layer_types")
        per_layer = d.get("per_layer_config")
        if per_layer:
            kwargs.update(_read_per_layer_config(per_layer, layer_types, d, where))
        else:
            # transformers' defaults when config.json gives neither form
            kwargs.setdefault("global_head_dim", 512)
            if d.get("attention_k_eq_v") is False:
                kwargs["num_global_key_value_heads"] = None
            else:
                kwargs.setdefault("num_global_key_value_heads", None)
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            kwargs.setdefault(key, None)
        if kwargs.get("rope_parameters") is None:
            kwargs.pop("rope_parameters", None)
        try:
            return cls(**kwargs)
        except TypeError as e:  # wrong value types from a hand-edited file
            raise ValueError(f"invalid text_config: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        """The config.json `text_config` dict in the released checkpoint's form: the global layers' head
        size and KV heads as `global_head_dim` / `num_global_key_value_heads` with `attention_k_eq_v`
        (their V is their K), which transformers 5.23 turns into its `per_layer_config` on reading and
        vLLM reads as they are (vLLM knows no `per_layer_config`)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self)}
        for name, default in _ADAPTED_DEFAULTS.items():  # a released checkpoint's file stays as it was
            if d[name] == default:
                del d[name]
        d["model_type"] = "diffusion_gemma_text"
        d["hidden_activation"] = "gelu_pytorch_tanh"
        d["tie_word_embeddings"] = True
        return d


def _read_per_layer_config(per_layer: dict, layer_types: list[str] | None, d: dict, where: str) -> dict[str, Any]:
    """Turn transformers' `per_layer_config` back into global_head_dim / num_global_key_value_heads.

    DiffusionGemma's global layers all share one override ({head_dim, num_key_value_heads}); any other
    pattern is not this architecture, so it is rejected rather than half-supported.
    """
    num_layers = d.get("num_hidden_layers")
    if layer_types is None and isinstance(num_layers, int):
        layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]
    layer_types = list(layer_types or [])
    if layer_types:
        layer_types[-1] = FULL
    full_layers = {i for i, t in enumerate(layer_types) if t == FULL}
    try:
        keyed = {int(k): v for k, v in per_layer.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"text_config.per_layer_config keys must be layer indices (got {list(per_layer)})") from e
    if set(keyed) != full_layers:
        raise ValueError(
            f"text_config.per_layer_config overrides layers {sorted(keyed)}, but the full-attention "
            f"layers are {sorted(full_layers)}; dgemma supports the Gemma 4 form only"
        )
    values = {json.dumps(v, sort_keys=True) for v in keyed.values()}
    if len(values) != 1:
        raise ValueError("text_config.per_layer_config must give every full-attention layer the same override")
    override = next(iter(keyed.values()))
    unknown = set(override) - {"head_dim", "num_key_value_heads"}
    if unknown:
        raise ValueError(f"text_config.per_layer_config: unsupported per-layer fields {sorted(unknown)}")
    check_types(override, {"head_dim": int, "num_key_value_heads": int | None}, f"{where}.per_layer_config")
    return {
        "global_head_dim": override.get("head_dim", d.get("head_dim", 256)),
        "num_global_key_value_heads": override.get("num_key_value_heads"),
    }


@dataclass(slots=True)
class DiffusionGemmaConfig:
    """The whole model (`config.json` of `model_type: diffusion_gemma`)."""

    text_config: TextConfig = field(default_factory=TextConfig)
    canvas_length: int = 256
    boi_token_id: int | None = 255_999
    eoi_token_id: int | None = 258_882
    image_token_id: int | None = 258_880
    vision_config: dict[str, Any] | None = None  # kept for round trips; dgemma runs text only

    def __post_init__(self) -> None:
        if not isinstance(self.canvas_length, int) or self.canvas_length <= 0:
            raise ValueError(f"canvas_length must be a positive integer (got {self.canvas_length!r})")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config.json") -> DiffusionGemmaConfig:
        """Build from config.json's object (types checked, misspelt keys refused); `source` names the file."""
        model_type = d.get("model_type")
        if model_type != "diffusion_gemma":
            raise ValueError(
                f"config.json has model_type {model_type!r}; dgemma loads 'diffusion_gemma' "
                "checkpoints (DiffusionGemmaForBlockDiffusion)"
            )
        if d.get("tie_word_embeddings") is False:
            raise ValueError(
                "config.json sets tie_word_embeddings=false; DiffusionGemma ties the LM head to the "
                "embeddings and shares the encoder and decoder weights"
            )
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{source} has no text_config object")
        names = [f.name for f in dataclasses.fields(cls)]
        _check_keys(d, [*names, "model_type", "tie_word_embeddings"], _CONFIG_KEYS_UNUSED, source)
        hints = {**typing.get_type_hints(cls), "canvas_length": int, "tie_word_embeddings": bool | None}
        check_types(d, {k: v for k, v in hints.items() if k != "text_config"}, source)
        return cls(
            text_config=TextConfig.from_dict(text, source),
            canvas_length=d.get("canvas_length", 256),
            boi_token_id=d.get("boi_token_id", 255_999),
            eoi_token_id=d.get("eoi_token_id", 258_882),
            image_token_id=d.get("image_token_id", 258_880),
            vision_config=d.get("vision_config"),
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "architectures": ["DiffusionGemmaForBlockDiffusion"],
            "model_type": "diffusion_gemma",
            "canvas_length": self.canvas_length,
            "boi_token_id": self.boi_token_id,
            "eoi_token_id": self.eoi_token_id,
            "image_token_id": self.image_token_id,
            "tie_word_embeddings": True,
            "text_config": self.text_config.to_dict(),
        }
        if self.vision_config is not None:
            d["vision_config"] = copy.deepcopy(self.vision_config)
        return d

    @classmethod
    def from_file(cls, path: str | Path) -> DiffusionGemmaConfig:
        """Read `config.json` (or the config.json inside a checkpoint directory)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a checkpoint directory needs a config.json")
        return cls.from_dict(_read_json_object(path), str(path))


@dataclass(slots=True)
class GenerationConfig:
    """Sampling defaults (`generation_config.json`); values a checkpoint leaves null take the reference's."""

    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        # the same rules as every generate call's (dgemma.generation.sampling), so a config that loads also generates
        errors = validate({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if errors:
            raise ValueError("invalid generation config: " + "; ".join(errors))

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "generation_config.json") -> GenerationConfig:
        """Build from generation_config.json's object: null values take the reference defaults, every other
        value's type is checked, a misspelt key is refused; `source` names the file in errors."""
        names = [f.name for f in dataclasses.fields(cls)]
        _check_keys(d, [*names, "sampler_config"], _GENERATION_LOOKALIKES, source, warn=False)
        d = {k: v for k, v in d.items() if v is not None}
        check_types(d, {**typing.get_type_hints(cls), "sampler_config": dict}, source)
        sampler = d.pop("sampler_config", None)
        if sampler:
            _check_keys(sampler, ["entropy_bound"], frozenset(), f"{source} sampler_config", warn=False)
            check_types(sampler, {"entropy_bound": float | None}, f"{source} sampler_config")
        if sampler and sampler.get("entropy_bound") is not None:
            d.setdefault("entropy_bound", sampler["entropy_bound"])
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["sampler_config"] = {"entropy_bound": d.pop("entropy_bound"), "_cls_name": "EntropyBoundSamplerConfig"}
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_file(cls, path: str | Path) -> GenerationConfig:
        """Read generation_config.json, or return the reference defaults when the file is absent."""
        path = Path(path)
        if path.is_dir():
            path = path / "generation_config.json"
        if not path.is_file():
            return cls()
        return cls.from_dict(_read_json_object(path), str(path))


# ------------------------------------------------------------------------------------------------
# Presets: the real model, and small models for tests, benchmarks and the project's own training.


__all__ = [
    "FULL",
    "SLIDING",
    "DiffusionGemmaConfig",
    "GenerationConfig",
    "LayerSpec",
    "TextConfig",
]
