"""What vLLM does when it loads a compressed-tensors DiffusionGemma checkpoint, restated from its source
for a static test (no vLLM, no GPU). Read in vLLM 0.34.0, the PyPI wheel of commit 62d4bc3c7 (it pins
compressed-tensors 0.17.0 and transformers < 5.23); `file:line` below are in that wheel:

  DG   vllm/model_executor/models/diffusion_gemma.py        G4  vllm/model_executor/models/gemma4.py
  CT   .../quantization/compressed_tensors/compressed_tensors.py
  CTU  .../quantization/compressed_tensors/utils.py         CFGU .../quantization/utils/config_utils.py
  CTMOE .../compressed_tensors_moe/compressed_tensors_moe.py  CTMOE_W16 ..._moe_wna16.py
  CTMOE_NV ..._moe_w4a4_nvfp4.py                             S_NV  .../schemes/compressed_tensors_w4a4_nvfp4.py
  S_W16 .../schemes/compressed_tensors_wNa16.py              RE   vllm/model_executor/layers/fused_moe/routed_experts.py
  MAR  .../quantization/utils/marlin_utils.py

`load(directory)` walks every module vLLM builds for the checkpoint's config, picks each one's scheme as
vLLM does (ignore list, targets, fused shards, class names), checks the scheme is one vLLM runs, and
consumes the checkpoint tensors that scheme's parameters take, by name, dtype and shape; any tensor
left over, or parameter left unfilled, is an error (vLLM itself does not notice unfilled parameters of
a quantized model: DL:549-560). Nothing here is vLLM's code.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

# DG:158-166: checkpoint prefix -> vLLM prefix, first match
PREFIXES = (
    ("model.decoder.self_conditioning.", "self_conditioning."),
    ("model.decoder.", "model."),
    ("model.encoder.language_model.", "model."),
    ("model.encoder.vision_tower.", "vision_tower."),
    ("model.encoder.embed_vision.", "embed_vision."),
)
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}  # DG:168-171
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)  # MAR:32
QUANTIZED_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "weight_shape", "weight_zero_point")


class Refused(ValueError):
    """vLLM would refuse the checkpoint, or load it wrongly."""


def to_vllm(name: str) -> str:
    for old, new in PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _match(value: str, target: str, contains: bool = False) -> bool:
    """CFGU:501-520: `re:` is re.match (anchored at the start only); else equality, or (class names)
    a case-insensitive substring."""
    if target.startswith("re:"):
        return re.match(target[3:], value) is not None
    return target.lower() in value.lower() if contains else target == value


@dataclass
class Config:
    """The `quantization_config` as vLLM reads it: groups keyed by target (CT:325-386, a target in two
    groups: the last wins), exact dotted names renamed by the prefix mapper, patterns not (CT:129-157)."""

    groups: dict[str, dict]
    ignore: list[str]

    @classmethod
    def of(cls, qc: dict) -> Config:
        if qc.get("quant_method") != "compressed-tensors":
            raise Refused(f"quant_method {qc.get('quant_method')!r}")

        def rename(t: str) -> str:
            return to_vllm(t) if "." in t and not t.startswith("re:") else t

        groups = {}
        for group in qc["config_groups"].values():
            group = dict(group, format=group.get("format") or qc.get("format"))
            for t in group["targets"]:
                groups[rename(t)] = group
        return cls(groups, [rename(t) for t in qc.get("ignore") or []])

    def ignored(self, layer: str) -> bool:
        """CTU:53-70: a fused layer is ignored when all its shards are (v_proj of a global layer too);
        some but not all is an error."""
        if any(_match(layer, t) for t in self.ignore):
            return True
        fused = next((k for k in PACKED if layer.endswith(k)), None)
        if fused is None:
            return False
        shards = [any(_match(layer.replace(fused, s), t) for t in self.ignore) for s in PACKED[fused]]
        if any(shards) and not all(shards):
            raise Refused(f"Found different quantization schemes for the shards of {layer}")
        return all(shards)

    def scheme(self, layer: str, cls_name: str) -> dict | None:
        """CT:998-1031 and CTU:73-176: the group of the first target matching the layer's name, else all of
        its shards' (the first shard's group), else its class name; None: left unquantized, silently."""
        if self.ignored(layer):
            return None
        for t in self.groups:
            if _match(layer, t):
                return self.groups[t]
        fused = next((k for k in PACKED if layer.endswith(k)), None)
        if fused:
            first = []
            for shard in PACKED[fused]:
                first.append(next((t for t in self.groups if _match(layer.replace(fused, shard), t)), None))
            if all(first):
                return self.groups[first[0]]
        for t in self.groups:
            if _match(cls_name, t, contains=True):
                return self.groups[t]
        return None


def _nvfp4_args(a: dict | None) -> bool:  # CT:420-437
    keys = ("strategy", "type", "num_bits", "group_size")
    return bool(a) and tuple(a.get(k) for k in keys) == ("tensor_group", "float", 4, 16) and a.get("symmetric", True)


def select(group: dict, moe: bool) -> str:
    """The scheme vLLM runs a group with (CT:783-949 for Linears, CTMOE:27-201 for experts), or Refused."""
    w, a, fmt = group["weights"], group.get("input_activations"), group.get("format")
    strategy = w.get("strategy") or (
        "channel" if w.get("group_size") == -1 else "group" if w.get("group_size") else "tensor"
    )
    if _nvfp4_args(w):
        if a is None:
            return "W4A16Fp4"
        if not _nvfp4_args(a):
            raise Refused("For NVFP4 weights, input quantization must also be NVFP4 format, None for NVFP4A16")
        return "W4A4Fp4"
    if a is None and strategy in ("channel", "group") and not w.get("dynamic"):
        if fmt != "pack-quantized" or (moe and not 2 <= w["num_bits"] <= 8):  # CT:698-709, CTMOE:90-103
            raise Refused(f"WNA16 needs format pack-quantized, got {fmt}")
        group_size = w.get("group_size") or -1
        if group_size == -1 and strategy != "channel":  # S_W16:83-88
            raise Refused("Pack-quantized format requires group quantization or channelwise quantization")
        if group_size not in MARLIN_GROUP_SIZES:  # MAR:32, MARK:53-61
            raise Refused(f"Marlin takes group sizes {MARLIN_GROUP_SIZES}, got {group_size}")
        return "WNA16"
    if fmt in ("float-quantized", "naive-quantized") and w["type"] == a["type"] == "float" and a.get("dynamic"):
        if moe and not (strategy == "channel" and a.get("strategy") == "token"):  # CTMOE_F8:66-87
            raise Refused("For FP8 Fused MoE layer, we require per tensor or channelwise, dynamic per token")
        return "W8A8Fp8"
    raise Refused(f"No compressed-tensors compatible scheme was found: {w}, {a}, {fmt}")


def expected(kind: str, group: dict, n_out: int, n_in: int) -> dict[str, tuple[set[torch.dtype], tuple]]:
    """The checkpoint tensors one shard (or one expert's projection) [n_out, n_in] fills under `kind`: local
    name -> (dtypes, shape; numel 1 as (1,)). S_NV:53-91, S_W16:155-236, FP8U:1376-1451, CTMOE_*."""
    w = group["weights"]
    if kind.startswith("W4A"):
        out = {
            "weight_packed": ({torch.uint8}, (n_out, n_in // 2)),
            "weight_scale": ({torch.float8_e4m3fn}, (n_out, n_in // 16)),
            "weight_global_scale": ({torch.float32}, (1,)),
        }
        return out | ({"input_global_scale": ({torch.float32}, (1,))} if kind == "W4A4Fp4" else {})
    if kind == "WNA16":
        g = w.get("group_size") or -1
        cols = 1 if g == -1 else n_in // g
        out = {
            "weight_packed": ({torch.int32}, (n_out, math.ceil(n_in * w["num_bits"] / 32))),
            "weight_scale": ({torch.float32, torch.bfloat16, torch.float16}, (n_out, cols)),
            "weight_shape": ({torch.int64}, (2,)),
        }
        if not w.get("symmetric", True):
            out["weight_zero_point"] = ({torch.int32}, (math.ceil(n_out * w["num_bits"] / 32), cols))
        return out
    return {"weight": ({torch.float8_e4m3fn}, (n_out, n_in)), "weight_scale": ({torch.float32}, (n_out, 1))}


class Checkpoint:
    """A checkpoint directory's tensors under vLLM's names, consumed as modules claim them."""

    def __init__(self, directory: Path):
        self.tensors: dict[str, torch.Tensor] = {}
        for f in sorted(directory.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():  # noqa: SIM118
                    self.tensors.setdefault(to_vllm(name), h.get_tensor(name))  # tied copies: one slot
        self.left = set(self.tensors)

    def take(self, name: str, dtypes: set[torch.dtype], shape: tuple) -> torch.Tensor:
        if name not in self.tensors:
            raise Refused(f"{name} is missing (vLLM would run with an uninitialised parameter)")
        t = self.tensors[name]
        if t.dtype not in dtypes:
            raise Refused(f"{name} is {t.dtype}, vLLM's parameter {sorted(map(str, dtypes))}")
        if (tuple(t.shape) if shape != (1,) else (t.numel(),)) != shape:
            raise Refused(f"{name} is {tuple(t.shape)}, vLLM's parameter {shape}")
        self.left.discard(name)
        return t


def load(directory: Path) -> dict[str, str]:
    """Walk the checkpoint as vLLM loads it; returns the scheme of every quantized module (vLLM's names)
    and raises Refused on the first thing vLLM would refuse or load wrongly."""
    from transformers import AutoConfig

    raw = json.loads((directory / "config.json").read_text())
    if raw.get("architectures") != ["DiffusionGemmaForBlockDiffusion"]:  # REG:429-432
        raise Refused(f"architectures {raw.get('architectures')}")
    text = AutoConfig.from_pretrained(directory).text_config  # vLLM's per-layer sizes (G4:600-602)
    qc = Config.of(raw["quantization_config"])
    ckpt = Checkpoint(directory)
    schemes: dict[str, str] = {}
    h, heads = text.hidden_size, text.num_attention_heads
    for i, layer_type in enumerate(text.layer_types):
        p, per = f"model.layers.{i}.", text.per_layer_config[i]
        hd, kv = per.head_dim, per.num_key_value_heads
        v_source = "k_proj" if layer_type == "full_attention" else "v_proj"  # DG:184-190, G4:100-122 (k_eq_v)
        shards = {"q_proj": (heads * hd, "q_proj"), "k_proj": (kv * hd, "k_proj"), "v_proj": (kv * hd, v_source)}
        _linear(ckpt, qc, schemes, p + "self_attn.qkv_proj", "QKVParallelLinear", shards, h)
        _linear(ckpt, qc, schemes, p + "self_attn.o_proj", "RowParallelLinear", {"o_proj": (h, "o_proj")}, heads * hd)
        inter = text.intermediate_size
        gate_up = {"gate_proj": (inter, "gate_proj"), "up_proj": (inter, "up_proj")}
        _linear(ckpt, qc, schemes, p + "mlp.gate_up_proj", "MergedColumnParallelLinear", gate_up, h)
        _linear(ckpt, qc, schemes, p + "mlp.down_proj", "RowParallelLinear", {"down_proj": (h, "down_proj")}, inter)
        if text.num_experts:
            _experts(ckpt, qc, schemes, p + "experts", text.num_experts, h, text.moe_intermediate_size)
            ckpt.take(p + "router.proj.weight", {torch.float32, torch.bfloat16}, (text.num_experts, h))  # G4:323-346
    for name in [n for n in ckpt.left if n.startswith("self_conditioning.") and n.endswith("_proj.weight")]:
        ckpt.take(name, {torch.float32, torch.bfloat16}, tuple(ckpt.tensors[name].shape))  # DG:82-97: plain Linear
    for name in [n for n in ckpt.left if n.startswith(("vision_tower.", "embed_vision.")) and n.endswith(".weight")]:
        if ckpt.tensors[name].dim() == 2 and qc.scheme(name.removesuffix(".weight"), "ReplicatedLinear") is not None:
            raise Refused(f"{name}: vLLM quantizes the vision tower's Linears the config does not ignore (DG:200-229)")
    quantized = [n for n in ckpt.left if n.rpartition(".")[2] in (*QUANTIZED_SUFFIXES, "input_global_scale")]
    if quantized:
        raise Refused(f"tensors no vLLM parameter takes: {sorted(quantized)[:5]}")
    return schemes


def _linear(ckpt: Checkpoint, qc: Config, schemes: dict, layer: str, cls_name: str, shards: dict, n_in: int) -> None:
    group = qc.scheme(layer, cls_name)
    parent = layer.rpartition(".")[0]
    if group is None:  # unquantized (no target matched, silently: CT:978-980)
        for _, source in shards.values():
            if f"{parent}.{source}.weight_scale" in ckpt.tensors:
                raise Refused(f"{layer} is left unquantized, so no vLLM parameter takes {parent}.{source}.weight_scale")
            name = f"{parent}.{source}.weight"
            ckpt.take(name, {torch.float32, torch.bfloat16, torch.float16}, _shape(ckpt, name))
        return
    kind = select(group, moe=False)
    schemes[layer] = kind
    globals_ = []
    for n_out, source in shards.values():
        for local, (dtypes, shape) in expected(kind, group, n_out, n_in).items():
            t = ckpt.take(f"{parent}.{source}.{local}", dtypes, shape)
            if local == "weight_global_scale":
                globals_.append(t.reshape(-1))
            if local == "weight_shape" and tuple(t.tolist()) != (n_out, n_in):
                raise Refused(f"{parent}.{source}.weight_shape is {t.tolist()}, not {[n_out, n_in]}")
    if len(globals_) > 1 and torch.unique(torch.cat(globals_)).numel() != 1:  # S_NV:99-111: warns, takes the max
        raise Refused(f"{layer}: the weight global scale is different for parallel layers")


def _shape(ckpt: Checkpoint, name: str) -> tuple:
    return tuple(ckpt.tensors[name].shape) if name in ckpt.tensors else ()


def _experts(ckpt: Checkpoint, qc: Config, schemes: dict, layer: str, num: int, h: int, inter: int) -> None:
    """CTMOE:27-58: expert 0's gate, up and down must resolve to one group (a "Linear" target stands for
    RoutedExperts); RE:1304-1319: per-expert tensors `experts.{e}.{gate,up,down}_proj.<param>`."""
    if "Linear" in qc.groups:
        qc.groups.setdefault("RoutedExperts", qc.groups["Linear"])
    found = [qc.scheme(f"{layer}.0.{p}", "RoutedExperts") for p in ("gate_proj", "up_proj", "down_proj")]
    if any(f != found[0] for f in found):
        raise Refused("All MoE projections need to have same quantization scheme but found multiple")
    group = found[0]
    if group is None:  # unquantized: the fused 3-D weights (RE:1257-1285)
        floats = {torch.float32, torch.bfloat16, torch.float16}
        ckpt.take(f"{layer}.gate_up_proj", floats, (num, 2 * inter, h))
        ckpt.take(f"{layer}.down_proj", floats, (num, h, inter))
        return
    kind = select(group, moe=True)
    g = group["weights"].get("group_size") or -1
    if kind == "WNA16" and g != -1 and (h % g or inter % g):  # CTMOE_W16:229-251
        raise Refused(f"{layer}: group {g} does not divide hidden {h} and intermediate {inter}")
    schemes[layer] = kind
    for e in range(num):
        parts = {"gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}
        scales = {}
        for part, (n_out, n_in) in parts.items():
            for local, (dtypes, shape) in expected(kind, group, n_out, n_in).items():
                t = ckpt.take(f"{layer}.{e}.{part}.{local}", dtypes, shape)
                scales[part, local] = t
        if kind.startswith("W4A") and not torch.equal(
            scales["gate_proj", "weight_global_scale"], scales["up_proj", "weight_global_scale"]
        ):
            raise Refused(f"{layer}.{e}: w1_weight_global_scale must match w3_weight_global_scale (CTMOE_NV:232-240)")
