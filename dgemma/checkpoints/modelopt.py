"""NVIDIA ModelOpt NVFP4 checkpoints (`nvidia/diffusiongemma-26B-A4B-it-NVFP4`) read as they are.

The file is compressed-tensors' NVFP4 under other names with the global scales inverted, so ModelOptSource
renames and inverts it on the fly and compressed_tensors.py's reader reads it: one reader. Tensor layout,
what is reported or refused: docs/formats.md, "ModelOpt NVFP4".
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch

from ..quant.formats import NVFP4_GROUP, QuantSpec
from .checks import check_values
from .vllm_export import quantization_config

_RENAMED = {"weight_scale_2": "weight_global_scale", "input_scale": "input_global_scale"}  # inverted too
# What ModelOpt's scales must hold (checks.check_values): the global scales are amax / (448 x 6) of a tensor,
# so > 0 (+inf inverted would make every weight 0, a NaN every output NaN); the per-group scales are >= 0,
# and not all 0 (every weight 0).
_RULES = {"weight_scale_2": "positive", "input_scale": "positive", "weight_scale": "scale"}
_KV_SCALES = ("k_scale", "v_scale")


def modelopt_config(directory: Path, config: dict) -> dict | None:
    """The ModelOpt quantization block of a checkpoint (config.json's `quantization_config` when its
    quant_method is "modelopt", else hf_quant_config.json's `quantization`), or None when it has none."""
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "modelopt":
        return qc
    side = directory / "hf_quant_config.json"
    if not side.is_file():
        return None
    try:
        block = json.loads(side.read_text()).get("quantization")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{side} is not a ModelOpt quantization file: {e}") from e
    if not isinstance(block, dict):
        raise ValueError(f"{side} has no 'quantization' object")
    return block


def check_modelopt(block: dict, where: str = "the ModelOpt config") -> bool:
    """Refuse what dgemma cannot run (a ValueError naming the key); True when the file holds a quantized
    KV cache that will not be used."""
    algo = block.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != "NVFP4":  # vLLM reads it upper-cased too
        raise ValueError(f"{where}: quant_algo {algo!r} is not supported by dgemma (only NVFP4 is)")
    group = block.get("group_size", NVFP4_GROUP)
    if group != NVFP4_GROUP:
        raise ValueError(f"{where}: NVFP4 needs group_size {NVFP4_GROUP}, got {group!r}")
    return bool(block.get("kv_cache_quant_algo"))


def compressed_tensors_config() -> dict:
    """The compressed-tensors `quantization_config` a ModelOpt NVFP4 file reads as: NVFP4 for every
    Linear that holds codes (ModelOptSource decides which do, by their tensors), as the exporter writes it."""
    return quantization_config({QuantSpec.of("nvfp4"): []}, ignore=[])


class ModelOptSource:
    """A ModelOpt NVFP4 checkpoint's tensors under compressed-tensors' names (the tensor source interface
    of dgemma/checkpoints/weights.py: names, shape, dtype, get, take): a module with a `weight_scale_2` has its uint8
    `weight` as `weight_packed` and its `weight_scale_2` / `input_scale` inverted into
    `weight_global_scale` / `input_global_scale`; the KV cache scales are dropped with a warning."""

    def __init__(self, source, kv_cache: bool = False):
        self.source = source
        quantized = {n.rpartition(".")[0] for n in source.names() if n.endswith(".weight_scale_2")}
        self.map: dict[str, str] = {}  # our name -> the file's
        dropped = []
        for name in source.names():
            module, _, local = name.rpartition(".")
            if local in _KV_SCALES:
                dropped.append(name)
                continue
            if module in quantized and local == "weight":
                if source.dtype(name) != "U8":
                    raise ValueError(f"{name}: a ModelOpt NVFP4 weight is uint8 codes, not {source.dtype(name)}")
                local = "weight_packed"
            elif local in _RENAMED and module in quantized:
                local = _RENAMED[local]
            elif local in _RENAMED:
                raise ValueError(f"{name} has no weight_scale_2 beside it: a scale of no NVFP4 weight")
            if local in _RENAMED.values():  # one value each: checked here (input_scale is read by nothing else)
                self._scalar(name)
            self.map[f"{module}.{local}"] = name
        if dropped or kv_cache:
            warnings.warn(
                f"the checkpoint's FP8 KV cache scales ({len(dropped)} tensors) are not used: dgemma keeps "
                "its KV cache in the model's dtype",
                stacklevel=3,
            )

    def _where(self, name: str) -> str:
        """A tensor's name, after its file's where the source knows it."""
        file = getattr(self.source, "where", {}).get(name)
        return f"{file}: {name}" if file is not None else name

    def _scalar(self, name: str) -> None:
        """A global scale (`weight_scale_2`, `input_scale`): one value, finite and > 0."""
        shape = tuple(self.source.shape(name))
        if math.prod(shape) != 1:
            raise ValueError(f"{self._where(name)} has shape {shape}; a ModelOpt global scale is one value")
        check_values(self.source.get(name), self._where(name), _RULES[name.rpartition(".")[2]])

    def names(self) -> list[str]:
        return list(self.map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.source.shape(self.map[name]))

    def dtype(self, name: str) -> str:
        return self.source.dtype(self.map[name])

    def get(self, name: str) -> torch.Tensor:
        t = self.source.get(self.map[name])
        if name.endswith(("weight_global_scale", "input_global_scale")):
            return (1 / t.float()).reshape(1)  # fp32, as compressed-tensors inverts it (checked > 0 on opening)
        if name.endswith(".weight_scale"):
            check_values(t, self._where(self.map[name]), _RULES["weight_scale"])
        return t

    def take(self, name: str) -> torch.Tensor:
        return self.get(name) if name.endswith("_global_scale") else self.source.take(self.map[name])
