"""compressed-tensors checkpoints read into dgemma's quantized modules, weights kept quantized.

RedHatAI's FP8-dynamic and NVFP4 and W4A16 int4 files load as they are, the per-expert Linears stacked
into dgemma's fused experts. Which formats stay quantized, what is dequantized on load and what is
refused: docs/formats.md, "compressed-tensors"; the tests against the library: docs/quantization.md.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass, field

import torch

from ..quant import QuantSpec, Spec
from ..quant.formats import NVFP4_GROUP, Quantized, dequantize, unpack_nibbles
from ..quant.modules import empty_buffers
from .checks import check_values

QPARAMS = {"weight_packed", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape"}
ACTIVATION_PARAMS = {"input_scale", "input_zero_point", "input_global_scale", "output_scale", "output_zero_point"}
KV_PARAMS = {"k_scale", "v_scale", "q_scale"}
SCALES = ("weight_scale", "weight_global_scale")
_DENSE = {"F64", "F32", "F16", "BF16"}  # safetensors' dtype names of a full-precision weight
_FLOATS = _DENSE | {"F8_E4M3"}  # of a scale (NVFP4's are e4m3)
_INTS = {"I8", "U8", "I32", "I64"}  # of a zero point, packed or not
_EXPERT = re.compile(r"^(?P<root>.+\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)$")
_KEPT = {  # (format, type, bits, strategy) -> dgemma mode
    ("float-quantized", "float", 8, "channel"): "fp8",
    ("float-quantized", "float", 8, "tensor"): "fp8",
    ("naive-quantized", "float", 8, "channel"): "fp8",
    ("naive-quantized", "float", 8, "tensor"): "fp8",
    ("int-quantized", "int", 8, "channel"): "int8",
    ("pack-quantized", "int", 8, "channel"): "int8",
    ("pack-quantized", "int", 4, "channel"): "int4",
    ("pack-quantized", "int", 4, "group"): "int4",
    ("nvfp4-pack-quantized", "float", 4, "tensor_group"): "nvfp4",
    ("nvfp4-pack-quantized", "float", 4, "group"): "nvfp4",
}
_DEQUANTIZED = {"float-quantized", "naive-quantized", "int-quantized", "pack-quantized"}


def is_compressed_tensors(config: dict) -> bool:
    """Whether a config.json dict describes a compressed-tensors checkpoint."""
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


@dataclass
class Scheme:
    """One config group's weight arguments, and the format its tensors are stored in."""

    format: str
    type: str
    num_bits: int
    strategy: str
    group_size: int | None
    symmetric: bool
    block: tuple[int, int] | None = None

    def mode(self) -> str | None:
        """dgemma's mode that stores these weights as they are, or None (dequantized on load)."""
        return _KEPT.get((self.format, self.type, self.num_bits, self.strategy))

    def describe(self) -> str:
        """How the config says the weights are stored, e.g. "int8 per channel (pack-quantized)"."""
        per = {"tensor": "per tensor", "channel": "per channel", "block": f"per block {self.block}"}
        return f"{self.type}{self.num_bits} {per.get(self.strategy, f'per group of {self.group_size}')} ({self.format})"

    def grid(self, n_out: int, n_in: int) -> tuple[int, int]:
        """The scales of a weight [n_out, n_in], rows x columns: one per tensor / row / group / block."""
        if self.strategy == "tensor":
            return 1, 1
        if self.strategy in ("group", "tensor_group"):
            return n_out, n_in // (self.group_size or n_in)
        if self.strategy == "block" and self.block:
            return -(-n_out // self.block[0]), -(-n_in // self.block[1])
        return n_out, 1


def _strategy(args: dict) -> str:
    if args.get("strategy"):
        return args["strategy"]
    g = args.get("group_size")
    return "tensor" if g is None else "channel" if g == -1 else "group"


def _format_of(weights: dict, inputs: dict | None, declared: str | None) -> str:
    """The storage format of a group: as declared, else what compressed-tensors infers for a Linear."""
    if declared and declared != "mixed-precision":
        return declared
    if weights["type"] == "float" and weights["num_bits"] == 4:
        return "nvfp4-pack-quantized" if weights.get("group_size") == NVFP4_GROUP else "mxfp4-pack-quantized"
    if weights["type"] == "int":
        return "int-quantized" if inputs else "pack-quantized"
    return "float-quantized" if inputs and inputs.get("type") == "float" else "naive-quantized"


@dataclass
class Config:
    """A compressed-tensors `quantization_config`: its groups in order, and what it ignores."""

    groups: list[tuple[list[str], Scheme]]
    ignore: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, qc: dict) -> Config:
        """The config of a config.json's `quantization_config`; a ValueError naming what is wrong."""
        try:
            return cls._parse(qc)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"quantization_config is not a compressed-tensors config dgemma can read: {e!r}") from e

    @classmethod
    def _parse(cls, qc: dict) -> Config:
        if qc.get("kv_cache_scheme"):
            raise ValueError("a quantized KV cache (kv_cache_scheme) is not supported by dgemma")
        if qc.get("quantization_status", "compressed") != "compressed":
            raise ValueError(f"quantization_status {qc.get('quantization_status')!r}: only compressed files load")
        groups = []
        for name, group in (qc.get("config_groups") or {}).items():
            weights = group.get("weights")
            if not isinstance(weights, dict) or not group.get("targets"):
                raise ValueError(f"config group {name!r} has no weight quantization or no targets")
            inputs = group.get("input_activations")
            block = weights.get("block_structure")
            scheme = Scheme(
                format=_format_of(weights, inputs, group.get("format") or qc.get("format")),
                type=weights["type"],
                num_bits=int(weights["num_bits"]),
                strategy=_strategy(weights),
                group_size=weights.get("group_size"),
                symmetric=bool(weights.get("symmetric", True)),
                block=tuple(block) if block else None,
            )
            groups.append((list(group["targets"]), scheme))
        return cls(groups, list(qc.get("ignore") or []))

    def scheme_for(self, module: str) -> Scheme | None:
        """The scheme of a Linear module by its checkpoint name: exact names before regexes before the
        class name "Linear" (compressed-tensors' order); None when ignored."""
        if any(_matches(module, target) for target in self.ignore):
            return None
        for rank in range(3):
            for targets, scheme in self.groups:
                if any(_rank(t) == rank and _matches(module, t) for t in targets):
                    return scheme
        return None


def _rank(target: str) -> int:
    return 1 if target.startswith("re:") else 2 if target == "Linear" else 0


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in (module, "Linear")


def _unpack_bytes(words: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """int32 words packed with `bits`-bit elements along the last dimension -> uint8 [..., n * bits / 8]:
    for 4 bits the two nibbles of each byte are elements 2k (low) and 2k+1, as dgemma packs int4."""
    return words.contiguous().view(torch.uint8)[..., : (n * bits + 7) // 8]


class Module:
    """One quantized Linear of the checkpoint: its tensors by local name, its scheme and dgemma spec."""

    def __init__(self, name: str, tensors: dict[str, str], scheme: Scheme, source):
        self.name, self.tensors, self.scheme, self.source = name, tensors, scheme, source
        mode = scheme.mode()
        if mode is None and scheme.format not in _DEQUANTIZED:
            raise ValueError(f"{name}: compressed-tensors format {scheme.format!r} is not supported by dgemma")
        if mode == "nvfp4" and scheme.group_size != NVFP4_GROUP:
            raise ValueError(f"{name}: NVFP4 needs groups of {NVFP4_GROUP}, got {scheme.group_size}")
        if scheme.format == "pack-quantized" and scheme.num_bits not in (4, 8):
            raise ValueError(f"{name}: {scheme.num_bits}-bit pack-quantized weights are not supported")
        static = sorted(set(tensors) & ACTIVATION_PARAMS)
        if static and not (mode == "nvfp4" and static == ["input_global_scale"]):
            raise ValueError(f"{name}: static activation quantization ({', '.join(static)}) is not supported")
        self.shape = self._check()
        if mode == "int4":
            group = scheme.group_size if scheme.strategy == "group" else None
            self.spec: QuantSpec | None = QuantSpec("int4", group, "symmetric" if scheme.symmetric else "asymmetric")
        elif mode == "nvfp4":
            self.spec = QuantSpec("nvfp4", NVFP4_GROUP)
        elif mode is not None and scheme.symmetric:
            self.spec = QuantSpec(mode)
        else:
            self.spec = None  # dequantized on load

    def _check(self) -> tuple[int, int]:
        """The weight's shape, after refusing tensors missing from, or of another dtype or shape than, what
        the config group's scheme stores: a ValueError naming the module, the scheme and the tensor."""
        s, says = self.scheme, f"{self.name}: config says {self.scheme.describe()}"
        codes = "weight_packed" if s.format in ("pack-quantized", "nvfp4-pack-quantized") else "weight"
        needed = [codes, "weight_scale"] + ["weight_shape"] * (s.format == "pack-quantized")
        needed += ["weight_global_scale"] * (s.format == "nvfp4-pack-quantized")
        needed += ["weight_zero_point"] * (not s.symmetric)
        if missing := [t for t in needed if t not in self.tensors]:
            raise ValueError(f"{says} but the checkpoint has no {', '.join(missing)}")
        n_out, n_in = shape = self._shape()
        if s.strategy in ("group", "tensor_group") and (not s.group_size or n_in % s.group_size):
            raise ValueError(f"{says}, which does not divide its {n_in} inputs")
        rows, cols = s.grid(n_out, n_in)
        code = {"pack-quantized": "I32", "nvfp4-pack-quantized": "U8"}.get(s.format)
        code = code or ("I8" if s.type == "int" else "F8_E4M3")
        zp_rows = -(-rows * s.num_bits // 32) if self._dtype("weight_zero_point") == "I32" else rows  # packed
        per_group = s.strategy in ("group", "tensor_group", "block")
        expect = {  # local name -> (dtypes, shape or number of values; None: the codes' own shape)
            codes: ({code}, (n_out, -(-n_in * s.num_bits // 32)) if code == "I32" else None),
            "weight_scale": (_FLOATS, (rows, cols) if per_group else rows * cols),
            "weight_global_scale": (_FLOATS, 1),
            "weight_zero_point": (_INTS, zp_rows * cols),
        }
        for local, (dtypes, want) in ((k, v) for k, v in expect.items() if k in self.tensors):
            have = tuple(self.source.shape(self.tensors[local]))
            if self._dtype(local) not in dtypes:
                raise ValueError(f"{says} but {local} is {self._dtype(local)}, not {' or '.join(sorted(dtypes))}")
            if want is not None and (have != want if isinstance(want, tuple) else math.prod(have) != want):
                want = want if isinstance(want, tuple) else f"{want} values"
                raise ValueError(f"{says}: {local} should be {want} for a weight {shape}, but is {have}")
        return shape

    def _dtype(self, local: str) -> str | None:
        return self.source.dtype(self.tensors[local]) if local in self.tensors else None

    def _get(self, local: str) -> torch.Tensor:
        t = self.source.get(self.tensors[local])
        return check_values(t, self.tensors[local]) if local in SCALES else t  # else the weights are NaN or inf too

    def _shape(self) -> tuple[int, int]:
        """The weight's [out, in]: its weight_shape, else its codes' (nvfp4: two codes a byte)."""
        if "weight_shape" in self.tensors:
            shape = tuple(int(v) for v in self._get("weight_shape").tolist())
        else:
            packed = "weight_packed" in self.tensors
            shape = tuple(self.source.shape(self.tensors["weight_packed" if packed else "weight"]))
            shape = (*shape[:-1], 2 * shape[-1]) if packed and shape else shape
        if len(shape) != 2:
            raise ValueError(f"{self.name}: the weight's shape is {shape}, not (out, in)")
        return shape

    def quantized(self) -> Quantized:
        """The weight in dgemma's layout for self.spec (codes, scales, zero points, global scale)."""
        spec, (n_out, n_in) = self.spec, self.shape
        scale = self._get("weight_scale")
        if spec.mode in ("fp8", "int8"):
            codes = self._get("weight_packed") if "weight_packed" in self.tensors else self._get("weight")
            if codes.dtype == torch.int32:  # pack-quantized int8: bytes offset by 128
                codes = (_unpack_bytes(codes, n_in, 8).to(torch.int16) - 128).to(torch.int8)
            return Quantized(spec.mode, codes, scale.float().reshape(-1, 1).expand(n_out, 1).contiguous(), self.shape)
        if spec.mode == "nvfp4":
            g = self._get("weight_global_scale").float().reshape(1, 1).expand(n_out, 1).contiguous()
            q = Quantized("nvfp4", self._get("weight_packed"), scale, self.shape, NVFP4_GROUP)
            q.global_scale = g
            return q
        codes = _unpack_bytes(self._get("weight_packed"), n_in, 4)
        q = Quantized("int4", codes, scale.reshape(n_out, -1), self.shape, spec.group_size or n_in, spec.zero)
        if spec.zero == "asymmetric":  # packed along the output dimension
            zp = self._get("weight_zero_point")
            q.zero_point = _unpack_nibbles(zp.t(), n_out).t().contiguous()
        return q

    def buffers(self) -> dict[str, torch.Tensor]:
        """dgemma's buffers for this weight by suffix ("" codes, "_scale", ...), or {"": dense weight}."""
        if self.spec is None:
            return {"": self.dense()}
        q = self.quantized()
        out = {"": q.codes, "_scale": q.scales}
        if q.zero_point is not None:
            out["_zero_point"] = q.zero_point
        if q.global_scale is not None:
            out["_global_scale"] = q.global_scale
        return out

    def dense(self) -> torch.Tensor:
        """The dequantized weight, in fp32 rounded once to the scale's dtype (the library's result)."""
        if self.spec is not None:
            q = self.quantized()
            return dequantize(q, decompressed_dtype(q))
        s, (n_out, n_in) = self.scheme, self.shape
        scale = self._get("weight_scale")
        if "weight_packed" in self.tensors:
            words = self._get("weight_packed")
            q = _unpack_bytes(words, n_in, 8).float() - 128 if s.num_bits == 8 else _unpack_nibbles(words, n_in) - 8.0
        else:
            q = self._get("weight").float()
        if "weight_zero_point" in self.tensors:  # packed (int32) along the output dimension, offset like q
            zp = self._get("weight_zero_point")
            if zp.dtype == torch.int32 and s.num_bits == 8:
                zp = _unpack_bytes(zp.t(), n_out, 8).t().float() - 128
            elif zp.dtype == torch.int32:
                zp = _unpack_nibbles(zp.t(), n_out).t() - 8.0
            q = q - _spread(zp.float(), n_out, n_in, s)
        return (q * _spread(scale.float(), n_out, n_in, s)).to(scale.dtype)


def decompressed_dtype(q: Quantized) -> torch.dtype:
    """The dtype compressed-tensors decompresses a weight into: its scale's (fp32 for dgemma's int8 and
    fp8, the stored one for files), bf16 for NVFP4."""
    return torch.bfloat16 if q.mode == "nvfp4" else q.scales.dtype


def _unpack_nibbles(words: torch.Tensor, n: int) -> torch.Tensor:
    """int32 words of 4-bit elements along the last dimension -> their unsigned values (0..15) as fp32."""
    return unpack_nibbles(_unpack_bytes(words, n, 4))[..., :n].float()


def _spread(t: torch.Tensor, n_out: int, n_in: int, s: Scheme) -> torch.Tensor:
    """A per-tensor / channel / group / block parameter repeated to the weight's shape [out, in]."""
    if s.strategy == "block" and s.block:
        return t.repeat_interleave(s.block[0], 0)[:n_out].repeat_interleave(s.block[1], 1)[:, :n_in]
    t = t.reshape(n_out, -1) if t.numel() > 1 else t.reshape(1, 1)
    return t.repeat_interleave(n_in // t.shape[1], 1) if t.shape[1] > 1 else t


class CompressedSource:
    """A checkpoint's tensors as dgemma's quantized layout presents them (the interface of weights'
    tensor source: names, shape, get, take): a quantized Linear as codes + scales under its weight's
    name, per-expert Linears stacked into fused experts (`experts.gate_up_proj`, `experts.down_proj`),
    everything else as stored. `specs` gives each quantized module's spec by checkpoint module name."""

    def __init__(self, source, quantization_config: dict, num_experts: int):
        self.source, self.num_experts = source, num_experts
        config = Config.parse(quantization_config)
        grouped: dict[str, dict[str, str]] = {}
        for name in source.names():
            module, _, local = name.rpartition(".")
            if local in KV_PARAMS:
                raise ValueError(f"{name}: a quantized KV cache is not supported by dgemma")
            if local in QPARAMS | ACTIVATION_PARAMS | {"weight"}:
                grouped.setdefault(module, {})[local] = name
        for tensors in grouped.values():  # codes without their scales would load as weights
            weight = tensors.get("weight")
            if weight and not set(tensors) & QPARAMS and source.dtype(weight) not in _DENSE:
                raise ValueError(f"{weight} holds {source.dtype(weight)} codes but the checkpoint has no weight_scale")
        grouped = {m: t for m, t in grouped.items() if set(t) & QPARAMS or _EXPERT.match(m)}  # else: as stored
        self.passthrough = [n for n in source.names() if n.rpartition(".")[0] not in grouped]
        parts: dict[str, Module | str] = {}  # module -> Module, or the name of a plain expert weight
        unused = 0
        for module, tensors in grouped.items():
            if not set(tensors) & QPARAMS:
                if "weight" not in tensors:
                    raise ValueError(f"{module} has {', '.join(sorted(tensors))} but no weight")
                parts[module] = tensors["weight"]
                continue
            scheme = config.scheme_for(module)
            if scheme is None:
                raise ValueError(f"{module} holds quantized tensors but no group of the quantization_config targets it")
            parts[module] = Module(module, tensors, scheme, source)
            unused += "input_global_scale" in tensors
        if unused:
            warnings.warn(
                f"{unused} NVFP4 activation scales (W4A4) are unused: dgemma runs these weights with "
                "unquantized activations (W4A16)",
                stacklevel=3,
            )
        self.parts = parts
        self.specs: dict[str, Spec] = {}
        self.virtual: dict[str, tuple[tuple, str, tuple[int, ...]]] = {}  # name -> (what to build, suffix, shape)
        self._plan(parts)
        self._built: dict[tuple, dict[str, torch.Tensor]] = {}

    def _plan(self, parts: dict[str, Module | str]) -> None:
        experts: dict[str, dict[tuple[int, str], Module | str]] = {}
        for module, part in parts.items():
            if m := _EXPERT.match(module):
                experts.setdefault(m["root"], {})[int(m["e"]), m["part"]] = part
                continue
            key = ("linear", module)
            self._add(key, f"{module}.weight", part.spec, part.shape)
            if part.spec is not None:
                self.specs[module] = part.spec
        for root, table in experts.items():
            missing = [f"{e}.{p}" for e in range(self.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
            missing = [k for k in missing if (int(k.split(".")[0]), k.split(".")[1]) not in table]
            if missing or len(table) != 3 * self.num_experts:
                raise ValueError(f"{root}: the checkpoint's per-expert weights do not cover {self.num_experts} experts")
            gate_up = [table[e, p] for e in range(self.num_experts) for p in ("gate_proj", "up_proj")]
            down = [table[e, "down_proj"] for e in range(self.num_experts)]
            specs = (_common_spec(gate_up), _common_spec(down))
            if None in specs:
                specs = (None, None)  # the fused experts are quantized whole or not at all
            else:
                self.specs[root] = specs[0] if specs[0] == specs[1] else specs
            for which, members, spec in (("gate_up_proj", gate_up, specs[0]), ("down_proj", down, specs[1])):
                if len(shapes := {_shape_of(m, self.source) for m in members}) > 1:
                    raise ValueError(f"{root}: the experts' {which} weights differ in shape: {sorted(shapes)}")
                n_out, n_in = _shape_of(members[0], self.source)
                rows = 2 * n_out if which == "gate_up_proj" else n_out
                self._add(("stack", root, which), f"{root}.{which}", spec, (self.num_experts, rows, n_in))

    def _add(self, key: tuple, weight: str, spec: QuantSpec | None, shape: tuple[int, ...]) -> None:
        if spec is None:
            self.virtual[weight] = (key, "", shape)
            return
        with torch.device("meta"):
            for suffix, t in empty_buffers(spec, shape).items():
                self.virtual[weight + suffix] = (key, suffix, tuple(t.shape))

    def names(self) -> list[str]:
        return self.passthrough + list(self.virtual)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.virtual[name][2] if name in self.virtual else self.source.shape(name)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.virtual:
            return self.source.get(name)
        key, suffix, _ = self.virtual[name]
        if key not in self._built:
            self._built[key] = self._build(key)
        built = self._built[key]
        tensor = built.pop(suffix)
        if not built:
            del self._built[key]
        return tensor

    def take(self, name: str) -> torch.Tensor:
        return self.get(name) if name in self.virtual else self.source.take(name)

    def _build(self, key: tuple) -> dict[str, torch.Tensor]:
        """All buffers of one module (a Linear, or one of the two stacks of a layer's experts)."""
        if key[0] == "linear":
            return self.parts[key[1]].buffers()
        _, root, which = key
        halves = ("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",)
        quantized = root in self.specs
        per_expert = []
        for e in range(self.num_experts):
            pieces = [self._piece(f"{root}.{e}.{p}", quantized) for p in halves]
            per_expert.append({k: torch.cat([b[k] for b in pieces], dim=-2) for k in pieces[0]})
        return {k: torch.stack([b[k] for b in per_expert]) for k in per_expert[0]}

    def _piece(self, module: str, quantized: bool) -> dict[str, torch.Tensor]:
        """One expert's half as buffers (a quantized stack) or as a dense fp32 weight."""
        part = self.parts[module]
        if quantized:
            return part.buffers()
        dense = self.source.get(part) if isinstance(part, str) else part.dense()
        return {"": dense.float()}


def _common_spec(members: list[Module | str]) -> QuantSpec | None:
    """The spec all members share, scale dtype included (so they stack), or None."""
    if not all(isinstance(m, Module) and m.spec is not None for m in members):
        return None
    kinds = {(m.spec, m.source.shape(m.tensors["weight_scale"])[1:], _scale_dtype(m)) for m in members}
    return members[0].spec if len(kinds) == 1 else None


def _scale_dtype(m: Module) -> str:
    return m.source.dtype(m.tensors["weight_scale"])


def _shape_of(member: Module | str, source) -> tuple[int, int]:
    return member.shape if isinstance(member, Module) else tuple(source.shape(member))
