"""GGUF files of DiffusionGemma (llama.cpp's `diffusion-gemma` conversion) read and written with `gguf`.

Q8_0 and Q4_0 stay quantized as dgemma's int8 and int4; other block types are decoded as they load.
Layout, block types and what is written: docs/formats.md, "GGUF".
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch

from ..model.config import FULL, SLIDING, DiffusionGemmaConfig, GenerationConfig, TextConfig
from ..quant import QuantSpec
from ..quant.formats import pack_nibbles
from .checks import check_counts, layer_count, number_field, shown, size_field
from .names import hf_name
from .sentencepiece import GEMMA_ARCHITECTURES, gemma_tokenizer_json

ARCH = "diffusion-gemma"
_LAYER = {  # GGUF blk.N.<name> -> dgemma layers.N.<name>
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "layer_output_scale.weight": "layer_scalar",
    "enc_layer_output_scale.weight": "encoder_layer_scalar",
}
_GLOBAL = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "self_cond_pre_norm.weight": "self_conditioning.pre_norm.weight",
    "self_cond_norm.weight": "self_conditioning.pre_norm.weight",  # PR #24427's name
    "self_cond_gate.weight": "self_conditioning.gate_proj.weight",
    "self_cond_up.weight": "self_conditioning.up_proj.weight",
    "self_cond_down.weight": "self_conditioning.down_proj.weight",
}
_SAMPLER = {  # diffusion.<key> -> generation_config.json
    "eb_max_steps": "max_denoising_steps",
    "eb_t_min": "t_min",
    "eb_t_max": "t_max",
    "eb_entropy_bound": "entropy_bound",
    "eb_stability_threshold": "stability_threshold",
    "eb_confidence_threshold": "confidence_threshold",
}
KEPT = {"Q8_0": QuantSpec("int8", 32), "Q4_0": QuantSpec("int4", 32, "symmetric")}
WRITABLE = ("bf16", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
SOFTCAP = 30.0  # llama.cpp's default final_logit_softcapping, and DiffusionGemma's


def gguf_path(path: str | os.PathLike) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory without weights."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        files = sorted(p.glob("*.gguf"))
        if len(files) == 1:
            return files[0]
        if len(files) > 1:
            raise ValueError(f"{p} holds {len(files)} GGUF files; pass the one to load")
    return None


def open_gguf(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ImportError("reading GGUF files needs the gguf package: pip install gguf") from e
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError / struct errors on a corrupt header
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def gguf_field(reader, key: str, default=None):
    """A metadata value; float32 ones as the shortest decimal that float32 gives back (1e-06, not
    9.99999997e-07), which is what the writer meant."""
    field = reader.fields.get(key)
    if field is None:
        return default
    try:
        value = field.contents()
    except UnicodeDecodeError as e:
        raise ValueError(f"the metadata value {key} is not UTF-8 text: {e}") from None
    return float(str(np.float32(value))) if field.types[0].name == "FLOAT32" else value


def required_fields(reader, path: Path, arch: str):
    """`get(key, default=None)`: the metadata value `arch.key` (or `default`), a ValueError naming the key
    when it has neither."""

    def get(key: str, default=None):
        value = gguf_field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: the metadata key {arch}.{key} is missing")
        return value

    return get


def sizes(get, path: Path, arch: str):
    """`size(key, default=None)`: the metadata value `arch.key` (required_fields' `get`) as a size
    (checks.size_field: a positive integer, refused by name otherwise); `default` 0 where it is absent."""

    def size(key: str, default: int | None = None) -> int:
        value = get(key, default)
        return value if value == 0 and default == 0 else size_field(value, str(path), f"{arch}.{key}")

    return size


def read_config(path: Path) -> tuple[DiffusionGemmaConfig, GenerationConfig]:
    """The model and sampler configuration a GGUF file's metadata describes."""
    reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if arch not in (ARCH, "diffusion-gemma4"):
        raise ValueError(f"{path} is a GGUF of architecture {arch!r}, not DiffusionGemma ({ARCH!r})")

    get = required_fields(reader, path, arch)
    size = sizes(get, path, arch)
    tensors = {t.name: t for t in reader.tensors}
    layers = size("block_count")
    check_counts(str(path), {f"{arch}.block_count": layers}, {f"{arch}.block_count": layer_count(tensors, "blk.")})
    layer_types, kv_sliding, kv_full = _layer_kinds(get, path, arch, layers)
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    embed, eps = tensors["token_embd.weight"], "attention.layer_norm_rms_epsilon"
    text = TextConfig(
        vocab_size=int(embed.shape[-1]),  # GGML order: [hidden, vocab]
        hidden_size=size("embedding_length"),
        intermediate_size=size("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=size("attention.head_count"),
        num_key_value_heads=kv_sliding.pop(),
        num_global_key_value_heads=kv_full.pop() if kv_full else None,
        head_dim=size("attention.key_length_swa"),
        global_head_dim=size("attention.key_length"),
        max_position_embeddings=size("context_length"),
        rms_norm_eps=number_field(get(eps), str(path), f"{arch}.{eps}"),
        sliding_window=size("attention.sliding_window"),
        layer_types=layer_types,
        rope_parameters=_rope(reader, get, tensors),
        final_logit_softcapping=_softcap(path, gguf_field(reader, f"{arch}.final_logit_softcapping")),
        num_experts=size("expert_count", 0) or None,
        top_k_experts=size("expert_used_count", 0) or None,
        moe_intermediate_size=size("expert_feed_forward_length", 0) or None,
        pad_token_id=_token_id(reader, path, "padding"),
        eos_token_id=_token_id(reader, path, "eos"),
        bos_token_id=_token_id(reader, path, "bos"),
    )
    canvas = gguf_field(reader, "diffusion.canvas_length")
    if not canvas:
        raise ValueError(f"{path}: diffusion.canvas_length is missing; is this a DiffusionGemma GGUF?")
    canvas = size_field(canvas, str(path), "diffusion.canvas_length")
    config = DiffusionGemmaConfig(
        text_config=text, canvas_length=canvas, boi_token_id=None, eoi_token_id=None, image_token_id=None
    )
    sampler = {ours: gguf_field(reader, f"diffusion.{key}") for key, ours in _SAMPLER.items()}
    generation = GenerationConfig.from_dict({k: v for k, v in sampler.items() if v is not None}, str(path))
    return config, generation


def _layer_kinds(get, path: Path, arch: str, layers: int) -> tuple[list[str], set[int], set[int]]:
    """Each layer's type, and the KV head counts of the sliding and of the full layers: per layer
    (`attention.sliding_window_pattern`, `attention.head_count_kv`, one entry a layer) or one for all."""
    sliding = get("attention.sliding_window_pattern", [(i + 1) % 6 != 0 for i in range(layers)])
    kv = get("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    for key, values in (("attention.sliding_window_pattern", sliding), ("attention.head_count_kv", kv)):
        if not isinstance(values, list) or len(values) != layers:
            count = f"{len(values)} entries" if isinstance(values, list) else f"the value {shown(values)}"
            raise ValueError(f"{path}: {arch}.{key} has {count}, but block_count says {layers} layers")
    layer_types = [SLIDING if s else FULL for s in sliding]
    kv = [size_field(k, str(path), f"{arch}.attention.head_count_kv") for k in kv]
    kv_sliding = {k for k, t in zip(kv, layer_types, strict=True) if t == SLIDING} or {kv[0]}
    return layer_types, kv_sliding, {k for k, t in zip(kv, layer_types, strict=True) if t == FULL}


def _softcap(path: Path, value: float | None) -> float | None:
    """The final logit softcap: 0 is none (llama.cpp skips the cap then); a file without the key gets
    llama.cpp's default of 30, as transformers always applies it (reported)."""
    if value is None:
        warnings.warn(f"{path} has no final_logit_softcapping; using {SOFTCAP}, as llama.cpp does", stacklevel=5)
        return SOFTCAP
    return float(value) or None


def _rope(reader, get, tensors) -> dict:
    """Sliding layers: default RoPE at rope.freq_base_swa; full layers: proportional RoPE whose rotated
    share is the count of finite entries of rope_freqs (the rest are 1e30: not rotated)."""
    factor = 1.0
    if "rope_freqs.weight" in tensors:
        freqs = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32)
        factor = float((freqs < 1e29).sum()) / len(freqs)
    return {
        SLIDING: {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa"))},
        FULL: {
            "rope_type": "proportional",
            "partial_rotary_factor": factor,
            "rope_theta": float(get("rope.freq_base")),
        },
    }


def read_tokenizer(path: Path) -> tuple[str, dict[str, str], str | None] | None:
    """The tokenizer a GGUF file carries, as (its tokenizers JSON, special tokens by name,
    `tokenizer.chat_template`). The JSON is `tokenizer.huggingface.json` (which dgemma writes), else the one
    dgemma.checkpoints.sentencepiece rebuilds from a Gemma SentencePiece vocabulary; None when neither."""
    from tokenizers import Tokenizer as HFTokenizer

    reader = open_gguf(path)
    source = gguf_field(reader, "tokenizer.huggingface.json")
    if source is None:
        source = _sentencepiece_source(reader, path)
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{path}: tokenizer.huggingface.json must be a string (got {shown(source)})")
    try:
        tok = HFTokenizer.from_str(source)
    except Exception as e:  # tokenizers raises a bare Exception on a malformed document
        raise ValueError(f"{path}: the tokenizer is not one the tokenizers library reads: {e}") from None
    special = {}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token"), ("unknown", "unk_token")):
        token_id = _token_id(reader, path, key)
        if token_id is not None and tok.id_to_token(token_id) is not None:
            special[name] = tok.id_to_token(token_id)
    return source, special, gguf_field(reader, "tokenizer.chat_template")


def _sentencepiece_source(reader, path: Path) -> str | None:
    """The tokenizers JSON of a Gemma GGUF's SentencePiece vocabulary (dgemma.checkpoints.sentencepiece), or
    None when the file stores another kind of tokenizer or none."""
    arch = gguf_field(reader, "general.architecture")
    if gguf_field(reader, "tokenizer.ggml.model") != "llama" or arch not in GEMMA_ARCHITECTURES:
        return None
    if gguf_field(reader, "tokenizer.ggml.add_space_prefix", False):
        raise ValueError(f"{path}: a SentencePiece vocabulary with add_space_prefix is not supported")
    pieces, types = gguf_field(reader, "tokenizer.ggml.tokens"), gguf_field(reader, "tokenizer.ggml.token_type")
    if not pieces or types is None:
        raise ValueError(f"{path}: tokenizer.ggml.tokens / token_type are missing or empty")
    if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        raise ValueError(f"{path}: tokenizer.ggml.tokens must be an array of strings")
    if not isinstance(types, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise ValueError(f"{path}: tokenizer.ggml.token_type must be an array of integers")
    unk, bos = _token_id(reader, path, "unknown"), _token_id(reader, path, "bos")
    add_bos = bool(gguf_field(reader, "tokenizer.ggml.add_bos_token", True))
    try:
        return gemma_tokenizer_json(pieces, types, unk_id=3 if unk is None else unk, bos_id=bos, add_bos=add_bos)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


def _token_id(reader, path: Path, key: str) -> int | None:
    """The id `tokenizer.ggml.<key>_token_id` (None when absent); a ValueError naming it when not an integer."""
    value = gguf_field(reader, f"tokenizer.ggml.{key}_token_id")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{path}: tokenizer.ggml.{key}_token_id must be an integer (got {shown(value)})")
    return value


def ggml_to_ours(name: str) -> str | None:
    """dgemma's parameter name of a GGUF tensor (None: not one, e.g. rope_freqs)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
        return f"layers.{parts[1]}.{_LAYER[parts[2]]}"
    return None


def tensor_shape(t) -> tuple[int, ...]:
    """A GGUF tensor's shape in PyTorch's order (GGML lists ne0, the input dimension, first)."""
    return tuple(int(n) for n in reversed(t.shape))


def decoded_tensor(t) -> torch.Tensor:
    """A tensor's values: typed ones as stored (BF16 arrives as bytes; integer types stay integers, for the
    reader to refuse by name where it wants floats), the rest decoded by gguf to fp32."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    kind = t.tensor_type
    if kind in (T.F32, T.F16, T.F64, T.I8, T.I16, T.I32, T.I64):
        return torch.from_numpy(np.array(t.data)).reshape(tensor_shape(t))
    if kind == T.BF16:
        return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16).reshape(tensor_shape(t))
    try:
        return torch.from_numpy(dequantize(t.data, kind)).reshape(tensor_shape(t))
    except NotImplementedError:
        raise ValueError(f"{t.name}: GGML type {kind.name} cannot be decoded by the gguf package") from None


def _kept(t) -> dict[str, torch.Tensor]:
    """A Q8_0 / Q4_0 tensor as dgemma's int8 / int4 buffers ("" codes, "_scale" fp16 per 32)."""
    *lead, n_in = tensor_shape(t)
    blocks = torch.from_numpy(np.array(t.data)).reshape(*lead, n_in // 32, -1)
    scale = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
    if t.tensor_type.name == "Q8_0":
        return {"": blocks[..., 2:].contiguous().view(torch.int8).reshape(*lead, n_in), "_scale": scale}
    qs = blocks[..., 2:]  # element i < 16 in the low nibble of byte i, element i + 16 in its high nibble
    nibbles = torch.cat((qs & 0xF, qs >> 4), dim=-1).reshape(*lead, n_in)
    return {"": pack_nibbles(nibbles), "_scale": scale}


class GGUFSource:
    """A GGUF file's tensors under the checkpoint names dgemma's loader reads (the interface of weights'
    tensor source: names, shape, get, take), Q8_0 / Q4_0 weights of linear layers and experts as codes +
    scales (`specs`: by checkpoint module name), everything else decoded."""

    def __init__(self, path: Path, keep: set[str]):
        reader = open_gguf(path)
        self.entries: dict[str, tuple] = {}  # checkpoint name -> (how to read, the GGUF tensor(s), suffix)
        self.specs: dict[str, QuantSpec] = {}
        self.unknown: list[str] = []
        tensors = {t.name: t for t in reader.tensors}
        split: dict[str, dict[str, object]] = {}
        for name, t in tensors.items():
            if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):  # split experts: fused below
                split.setdefault(name.rsplit(".", 2)[0], {})[name.split(".")[-2]] = t
                continue
            ours = ggml_to_ours(name)
            if ours is None:
                if name != "rope_freqs.weight":
                    self.unknown.append(name)
                continue
            module = ours.removesuffix(".weight")
            spec = KEPT.get(t.tensor_type.name)
            if ".experts." in ours:
                self.entries[hf_name(ours)] = ("value", t, "")  # decided per layer below
            elif spec is not None and module in keep and tensor_shape(t)[-1] % 32 == 0:
                self.specs[hf_name(module)] = spec
                self._add_kept(hf_name(ours), t, spec)
            else:
                self.entries[hf_name(ours)] = ("value", t, "")
        self._keep_experts(tensors, keep)
        for block, parts in split.items():
            if set(parts) != {"ffn_gate_exps", "ffn_up_exps"}:
                raise ValueError(f"{path}: {block} has {sorted(parts)} but needs both ffn_gate_exps and ffn_up_exps")
            if f"{block}.ffn_gate_up_exps.weight" in tensors:
                raise ValueError(f"{path}: {block} holds its experts twice, fused (ffn_gate_up_exps) and split")
            if tensor_shape(parts["ffn_gate_exps"]) != tensor_shape(parts["ffn_up_exps"]):
                shapes = f"{tensor_shape(parts['ffn_gate_exps'])} and {tensor_shape(parts['ffn_up_exps'])}"
                raise ValueError(f"{path}: {block}.ffn_gate_exps and ffn_up_exps differ in shape: {shapes}")
            self.entries[hf_name(f"layers.{block.split('.')[1]}.experts.gate_up_proj")] = (
                "fuse",
                (parts["ffn_gate_exps"], parts["ffn_up_exps"]),
                "",
            )
        self._scalars(path)

    def _keep_experts(self, tensors: dict, keep: set[str]) -> None:
        """A layer's experts stay quantized when both stacks are Q8_0 / Q4_0 (else they are decoded)."""
        for name, t in tensors.items():
            if not name.endswith("ffn_gate_up_exps.weight"):
                continue
            layer = name.split(".")[1]
            down = tensors.get(f"blk.{layer}.ffn_down_exps.weight")
            specs = (KEPT.get(t.tensor_type.name), KEPT.get(down.tensor_type.name) if down is not None else None)
            if None in specs or f"layers.{layer}.experts" not in keep:
                continue
            self.specs[hf_name(f"layers.{layer}.experts")] = specs[0] if specs[0] == specs[1] else specs
            for tensor, which in ((t, "gate_up_proj"), (down, "down_proj")):
                ours = hf_name(f"layers.{layer}.experts.{which}")
                del self.entries[ours]
                self._add_kept(ours, tensor, KEPT[tensor.tensor_type.name])

    def _add_kept(self, weight: str, t, spec: QuantSpec) -> None:
        from ..quant.modules import empty_buffers

        with torch.device("meta"):
            for suffix, b in empty_buffers(spec, tensor_shape(t)).items():
                self.entries[weight + suffix] = ("kept", t, suffix, tuple(b.shape))

    def _scalars(self, path: Path) -> None:
        """PR #24427 files carry one layer scalar: it serves the prompt pass too (reported)."""
        missing = []
        for name, entry in list(self.entries.items()):
            if name.endswith(".layer_scalar") and name.startswith("model.decoder."):
                layer = name.split(".")[3]
                enc = hf_name(f"layers.{layer}.encoder_layer_scalar")
                if enc not in self.entries:
                    self.entries[enc] = entry
                    missing.append(layer)
        if missing:
            warnings.warn(
                f"{path}: no enc_layer_output_scale in {len(missing)} layers; their layer_output_scale serves "
                "the prompt pass too (llama.cpp PR #24427's layout)",
                stacklevel=4,
            )

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        entry = self.entries[name]
        if entry[0] == "kept":
            return entry[3]
        if entry[0] == "fuse":
            gate = tensor_shape(entry[1][0])
            return (*gate[:-2], 2 * gate[-2], gate[-1])
        return tensor_shape(entry[1])

    def dtype(self, name: str) -> str:
        return str(self.entries[name][1].tensor_type.name) if self.entries[name][0] != "fuse" else "F32"

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        if entry[0] == "kept":
            return _kept(entry[1])[entry[2]]
        if entry[0] == "fuse":
            return torch.cat([decoded_tensor(t).float() for t in entry[1]], dim=-2)
        return decoded_tensor(entry[1])

    take = get


# ------------------------------------------------------------------------------------------------
# Writing


def _names_out(model) -> dict[str, str]:
    """dgemma parameter name -> GGUF tensor name."""
    out = {v: k for k, v in _GLOBAL.items() if k != "self_cond_norm.weight"}
    for i in range(model.text_config.num_hidden_layers):
        out |= {f"layers.{i}.{ours}": f"blk.{i}.{name}" for name, ours in _LAYER.items()}
    return out


def _metadata(writer, model, generation: GenerationConfig | None) -> None:
    text, a = model.text_config, ARCH
    layers = text.layers
    uint32 = {
        "block_count": text.num_hidden_layers,
        "context_length": text.max_position_embeddings,
        "embedding_length": text.hidden_size,
        "feed_forward_length": text.intermediate_size,
        "attention.head_count": text.num_attention_heads,
        "attention.key_length": text.global_head_dim,
        "attention.value_length": text.global_head_dim,
        "attention.key_length_swa": text.head_dim,
        "attention.value_length_swa": text.head_dim,
        "attention.sliding_window": text.sliding_window,
        "rope.dimension_count": text.global_head_dim,
        "rope.dimension_count_swa": text.head_dim,
    }
    for key, value in uint32.items():
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_array(f"{a}.attention.head_count_kv", [spec.num_key_value_heads for spec in layers])
    writer.add_array(f"{a}.attention.sliding_window_pattern", [spec.is_sliding for spec in layers])
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", text.rms_norm_eps)
    writer.add_float32(f"{a}.rope.freq_base", float(text.rope_parameters[FULL]["rope_theta"]))
    writer.add_float32(f"{a}.rope.freq_base_swa", float(text.rope_parameters[SLIDING]["rope_theta"]))
    writer.add_float32(f"{a}.final_logit_softcapping", float(text.final_logit_softcapping or 0))  # 0: none
    if text.has_experts:
        writer.add_uint32(f"{a}.expert_count", text.num_experts)
        writer.add_uint32(f"{a}.expert_used_count", text.top_k_experts)
        writer.add_uint32(f"{a}.expert_feed_forward_length", text.moe_intermediate_size)
    writer.add_uint32(f"{a}.attention.shared_kv_layers", 0)
    writer.add_bool(f"{a}.attention.causal", False)
    eos = text.eos_token_ids[0] if text.eos_token_ids else None  # GGUF has one; the first is the model's own
    for token_id, setter in ((text.bos_token_id, writer.add_bos_token_id), (eos, writer.add_eos_token_id)):
        if token_id is not None:
            setter(token_id)
    if text.pad_token_id is not None:
        writer.add_pad_token_id(text.pad_token_id)
    writer.add_uint32("diffusion.canvas_length", model.config.canvas_length)
    if generation is not None:
        for key, ours in _SAMPLER.items():
            value = getattr(generation, ours)
            (writer.add_uint32 if isinstance(value, int) else writer.add_float32)(f"diffusion.{key}", value)


def _tokenizer_metadata(writer, tokenizer) -> None:
    """The vocabulary as GGUF lists it, plus the exact tokenizers JSON and the chat template."""
    import json

    from gguf import TokenType

    hf = json.loads(tokenizer.to_json())
    vocab = tokenizer.vocab()
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    special = {t["content"] for t in hf.get("added_tokens", []) if t.get("special")}
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list([t if t is not None else f"<unused{i}>" for i, t in enumerate(tokens)])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    merges = hf.get("model", {}).get("merges") or []
    if merges:
        writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_string("tokenizer.huggingface.json", tokenizer.to_json())
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write(model, path: str | os.PathLike, qtype: str = "bf16", tokenizer=None) -> Path:
    """Write a full-precision dgemma model as a DiffusionGemma GGUF (PR #24423's layout): the weight
    matrices in `qtype` (one of WRITABLE, by gguf's quantizers; a matrix whose rows do not divide into
    the type's blocks falls back to Q8_0, then F16, as llama.cpp does), norms, scalars and the router in
    F32, the tokenizer and chat template in the metadata when given."""
    from gguf import GGMLQuantizationType as T
    from gguf import GGUFWriter
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import quantize

    from ..quant import QuantExperts, QuantLinear

    if qtype not in WRITABLE:
        raise ValueError(f"GGUF type {qtype!r} is not written by dgemma; choose one of {', '.join(WRITABLE)}")
    if any(isinstance(m, QuantLinear | QuantExperts) for m in model.modules()):
        raise ValueError("GGUF is written from full-precision weights; load the checkpoint without --quant")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out), arch=ARCH)
    _metadata(writer, model, getattr(model, "generation_config", None))
    if tokenizer is not None:
        _tokenizer_metadata(writer, tokenizer)
    names = _names_out(model)
    target = T[qtype.upper()]
    rope, n = model.text_config.rope_parameters[FULL], model.text_config.global_head_dim // 2
    rotated = round(float(rope.get("partial_rotary_factor", 1.0)) * n)  # the rest: 1e30, not rotated
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * rotated + [1e30] * (n - rotated), dtype=np.float32))
    for ours, tensor in model.state_dict().items():
        if ours not in names:
            raise ValueError(f"{ours} has no name in DiffusionGemma's GGUF layout (a vision tower is not written)")
        values = tensor.detach().float().cpu().numpy()
        if tensor.dim() < 2 or ".router." in ours:  # norms, scalars, the router: F32, as llama.cpp keeps them
            writer.add_tensor(names[ours], values.astype(np.float32))
            continue
        kind = next(k for k in (target, T.Q8_0, T.F16) if values.shape[-1] % GGML_QUANT_SIZES[k][0] == 0)
        data = quantize(values, kind)
        writer.add_tensor(names[ours], data, raw_dtype=None if kind == T.F16 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
