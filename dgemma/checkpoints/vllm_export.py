"""compressed-tensors checkpoints that vLLM loads: the hand-off from one machine to vLLM's tensor and
pipeline parallelism (`dgemma quantize --format compressed-tensors`, `dgemma.save(format=...)`).

What each export is written as and how vLLM runs it: docs/formats.md, "The vLLM export"; what vLLM needs
beyond the tensor layout, the `vllm serve` commands and the checks: docs/quantization.md, "Handing off to vLLM".
"""

from __future__ import annotations

import re
import warnings

import torch

from ..quant import QuantExperts, QuantLinear, QuantSpec, fused_amax, fused_group
from ..quant.formats import FP4_MAX, FP8_MAX, Quantized, dequantize, pack_nibbles, quantize_nvfp4
from .names import hf_name, hf_state_dict

MARLIN_GROUP_SIZES = (32, 64, 128)  # vLLM's Marlin kernels: these, or -1 (per channel)
# the language model's layers, under the checkpoint's prefix and vLLM's (which does not rename patterns)
_LAYERS = r"model\.(decoder\.)?layers\."
# never quantized by vLLM or dgemma, named by patterns too: vLLM quantizes the vision tower's Linears
# under a "Linear" target unless ignored, and matches patterns against its own names
_IGNORED = (r"re:.*vision_tower\.", r"re:.*embed_vision\.", r"re:.*self_conditioning\.", r"re:.*router\.")
# our module suffix -> the pattern of its kind, matching the checkpoint's name and vLLM's fused module
_KINDS = (
    (re.compile(r"self_attn\.[qkv]_proj$"), r"self_attn\.(q|k|v|qkv)_proj"),
    (re.compile(r"self_attn\.o_proj$"), r"self_attn\.o_proj"),
    (re.compile(r"mlp\.(gate|up)_proj$"), r"mlp\.(gate|up|gate_up)_proj"),
    (re.compile(r"mlp\.down_proj$"), r"mlp\.down_proj"),
    (re.compile(r"experts$"), r"experts(\.\d+\.(gate|up|down)_proj)?"),
)


def check_spec(spec: QuantSpec) -> None:
    """Refuse a spec with no compressed-tensors form vLLM runs (a ValueError that says what to do)."""
    if spec.mode != "int4":
        return
    if spec.zero == "mid":
        raise ValueError(
            "dgemma's own int4 (codes read as q + 0.5) has no compressed-tensors form; quantize from the "
            "full-precision checkpoint for it (dgemma quantize --format compressed-tensors --quant int4)"
        )
    if spec.group_size is not None and spec.group_size not in MARLIN_GROUP_SIZES:
        raise ValueError(
            f"int4 groups of {spec.group_size}: vLLM's Marlin kernels take groups of "
            f"{', '.join(map(str, MARLIN_GROUP_SIZES))} inputs (or one scale per channel); choose --group-size "
            "32, 64 or 128"
        )


def vllm_path(spec: QuantSpec, w4a4: bool = False) -> str:
    """The scheme and kernel vLLM runs an export of `spec` with, in words."""
    if spec.mode == "fp8":
        return "FP8_DYNAMIC -> vLLM W8A8Fp8 (FP8 GEMM on Ada/Hopper/Blackwell, Marlin W8A16 on Ampere)"
    if spec.mode == "nvfp4" and w4a4:
        return "NVFP4 W4A4 (calibrated input scales) -> vLLM W4A4Fp4 (CUTLASS FP4 on Blackwell, weight-only elsewhere)"
    if spec.mode == "nvfp4":
        return "NVFP4A16 -> vLLM W4A16Fp4 (Marlin FP4, weight-only)"
    bits = 8 if spec.mode == "int8" else 4
    per = f"group {spec.group_size}" if spec.group_size else "channel"
    return f"W{bits}A16 per {per} -> vLLM WNA16 (Marlin; experts: WNA16 MoE)"


def _weights_args(spec: QuantSpec, w4a4: bool) -> tuple[dict, dict | None, str]:
    """A spec's compressed-tensors weight arguments, input activation arguments and format."""
    if spec.mode == "fp8":  # FP8_DYNAMIC: vLLM quantizes the activations per token, as --kernels fast does
        tokens = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token", "dynamic": True}
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}, tokens, "float-quantized"
    if spec.mode == "int8":
        args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": -1}
        return args, None, "pack-quantized"
    if spec.mode == "nvfp4":
        args = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
        args |= {"scale_dtype": "torch.float8_e4m3fn"}
        inputs = args | {"dynamic": "local", "observer": "static_minmax"} if w4a4 else None
        return args, inputs, "nvfp4-pack-quantized"
    per = (
        {"strategy": "group", "group_size": spec.group_size}
        if spec.group_size
        else {"strategy": "channel", "group_size": -1}
    )
    return {"num_bits": 4, "type": "int", "symmetric": spec.zero == "symmetric"} | per, None, "pack-quantized"


def _words(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> int32 [..., ceil(n / 4)] (little-endian, zero padded), as compressed-tensors packs."""
    pad = -b.shape[-1] % 4
    return torch.nn.functional.pad(b, (0, pad)).contiguous().view(torch.int32)


def compressed_tensors_of(q: Quantized) -> dict[str, torch.Tensor]:
    """One quantized weight [out, in] as compressed-tensors stores it, by local name."""
    n_out, n_in = q.shape
    if q.mode == "fp8":
        return {"weight": q.codes, "weight_scale": q.scales}
    shape = {"weight_shape": torch.tensor([n_out, n_in], dtype=torch.int64)}
    if q.mode == "int8":
        codes = (q.codes.to(torch.int16) + 128).to(torch.uint8)
        return {"weight_packed": _words(codes), "weight_scale": q.scales} | shape
    if q.mode == "nvfp4":
        g = q.global_scale.reshape(-1)
        if not torch.equal(g, g[:1].expand_as(g)):
            raise ValueError("an NVFP4 Linear has one global scale; these rows have several")
        return {"weight_packed": q.codes, "weight_scale": q.scales, "weight_global_scale": g[:1].clone()}
    out = {"weight_packed": _words(q.codes), "weight_scale": q.scales} | shape
    if q.zero_point is not None:  # packed along the output dimension
        out["weight_zero_point"] = _words(pack_nibbles(q.zero_point.t().contiguous())).t().contiguous()
    return out


def _split_rows(q: Quantized, rows: slice) -> Quantized:
    """The output rows `rows` of a quantized matrix (the gate or the up half of an expert)."""

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[rows]

    n = len(range(*rows.indices(q.shape[0])))
    return Quantized(
        q.mode, q.codes[rows], q.scales[rows], (n, q.shape[1]), q.group_size, q.zero,
        pick(q.zero_point), pick(q.global_scale),
    )  # fmt: skip


def _regroup(q: Quantized, group: int | None) -> Quantized:
    """An int4 weight's scales (and zero points) repeated onto a finer grid of `group` inputs (None: per
    channel): the same weight under another group size."""
    n_out, n_in = q.shape
    group = group or n_in
    if (q.group_size or n_in) == group:
        return q
    times = (q.group_size or n_in) // group

    def spread(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.reshape(n_out, -1).repeat_interleave(times, dim=-1).contiguous()

    return Quantized(q.mode, q.codes, spread(q.scales), q.shape, group, q.zero, spread(q.zero_point))


def _common_expert_spec(module: QuantExperts, name: str) -> QuantSpec:
    """The one spec vLLM can run a layer's experts with (gate, up and down alike): their own when they
    share it, else int4 at the coarsest Marlin group that divides both (scales repeated, see _regroup)."""
    gate_up, down = module.specs["gate_up_proj"], module.specs["down_proj"]
    if gate_up == down:
        return gate_up
    n_ins = (module.shapes["gate_up_proj"][2], module.shapes["down_proj"][2])
    if gate_up.mode == down.mode == "int4" and gate_up.zero == down.zero:
        for g in sorted(MARLIN_GROUP_SIZES, reverse=True):
            if all(n % g == 0 and (s.group_size or n) % g == 0 for n, s in zip(n_ins, (gate_up, down), strict=True)):
                return QuantSpec("int4", g, gate_up.zero)
    raise ValueError(
        f"{name}: vLLM runs an expert's gate, up and down under one scheme, but these are stored as "
        f"{gate_up} and {down} with no common form; quantize from the full-precision checkpoint"
    )


def _shared_nvfp4(linears: dict[str, tuple[Quantized, QuantSpec]]) -> None:
    """Give every fused NVFP4 group one global scale: requantize, from its dequantized weights, a group
    whose members hold several (a model quantized without sharing, or merged since)."""
    done: set[str] = set()
    for name, (_, spec) in linears.items():
        group = [m for m in fused_group(name) if m in linears]
        if spec.mode != "nvfp4" or name in done or len(group) == 1:
            continue
        done |= set(group)
        scales = {float(linears[m][0].global_scale.reshape(-1)[0]) for m in group}
        if len(scales) == 1:
            continue
        weights = {m: dequantize(linears[m][0]) for m in group}
        amax = fused_amax(name, weights.get)
        for m, w in weights.items():
            linears[m] = (quantize_nvfp4(w, amax), linears[m][1])
        warnings.warn(
            f"{', '.join(group)} hold different NVFP4 global scales, and vLLM runs them as one matmul with "
            "one: requantized with the group's (quantizing the full-precision checkpoint avoids rounding twice)",
            stacklevel=3,
        )


def _input_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' NVFP4 global scale for a range: 448 * 6 / max|x| (fp32 [1])."""
    return (FP8_MAX * FP4_MAX / amax.float().clamp_min(torch.finfo(torch.float32).tiny)).reshape(1)


def export(model, input_amax: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """A dgemma model's tensors under compressed-tensors names (quantized Linears as codes + scales, the
    experts one Linear each, gate / up / down, as llm-compressor writes them; the rest as dgemma saves
    them) and the `quantization_config` that describes them in a form vLLM loads (module docstring).
    With `input_amax` (quant/calibrate.py: every quantized Linear's and expert's input range) an NVFP4
    export is W4A4, with `input_global_scale`s. Refuses a model with nothing quantized, and specs vLLM
    cannot run (check_spec)."""
    linears: dict[str, tuple[Quantized, QuantSpec]] = {}
    experts: dict[str, tuple[QuantExperts, QuantSpec]] = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            linears[name] = (module.quantized(), module.spec)
        elif isinstance(module, QuantExperts):
            experts[name] = (module, _common_expert_spec(module, name))
    if not linears and not experts:
        raise ValueError("the model has no quantized weights; quantize it first (--quant)")
    for spec in {spec for _, spec in [*linears.values(), *experts.values()]}:
        check_spec(spec)
    _check_groups(linears)
    _shared_nvfp4(linears)
    w4a4 = input_amax is not None
    if w4a4 and any(spec.mode != "nvfp4" for _, spec in [*linears.values(), *experts.values()]):
        raise ValueError("calibrated activation scales (W4A4) are for NVFP4 exports only")
    tensors: dict[str, torch.Tensor] = {}
    members: dict[QuantSpec, list[str]] = {}

    def put(ours: str, q: Quantized, amax_key: str) -> None:
        hf = hf_name(ours)
        tensors.update({f"{hf}.{k}": v.contiguous() for k, v in compressed_tensors_of(q).items()})
        if w4a4:
            if amax_key not in input_amax:
                raise ValueError(f"no calibrated input range for {ours}")
            tensors[f"{hf}.input_global_scale"] = _input_global_scale(input_amax[amax_key])

    for name, (q, spec) in linears.items():
        # one activation range per fused group (the same input): the largest its members saw
        seen = [m for m in fused_group(name) if w4a4 and m in input_amax]
        put(name, q, max(seen, key=input_amax.get) if seen else name)
        members.setdefault(spec, []).append(name)
    for root, (module, spec) in experts.items():
        for e in range(module.shapes["gate_up_proj"][0]):
            gate_up, down = module.quantized("gate_up_proj", e), module.quantized("down_proj", e)
            if spec.mode == "int4":
                gate_up, down = _regroup(gate_up, spec.group_size), _regroup(down, spec.group_size)
            half = gate_up.shape[0] // 2
            put(f"{root}.{e}.gate_proj", _split_rows(gate_up, slice(0, half)), f"{root}.{e}.gate_up_proj")
            put(f"{root}.{e}.up_proj", _split_rows(gate_up, slice(half, None)), f"{root}.{e}.gate_up_proj")
            put(f"{root}.{e}.down_proj", down, f"{root}.{e}.down_proj")
        members.setdefault(spec, []).append(root)
    held = {f"{n}.{b}" for n in [*linears, *experts] for b, _ in model.get_submodule(n).named_buffers(recurse=False)}
    ours = dict(model.state_dict())
    tensors |= {hf: t for (hf, t), name in zip(hf_state_dict(model), ours, strict=True) if name not in held}
    return tensors, quantization_config(members, _ignored(tensors, members), w4a4)


def _check_groups(linears: dict[str, tuple[Quantized, QuantSpec]]) -> None:
    """Refuse a fused group (q / k / v, gate / up) whose members are stored differently."""
    for name, (_, spec) in linears.items():
        others = {m: linears[m][1] for m in fused_group(name) if m in linears and linears[m][1] != spec}
        if others:
            raise ValueError(
                f"vLLM runs {', '.join(fused_group(name))} as one matmul under one scheme, but {name} is stored "
                f"as {spec} and {', '.join(f'{m} as {s}' for m, s in others.items())}"
            )


def _kind(name: str) -> tuple[str, str]:
    """(layer index, kind pattern) of a quantized module's name (ours: `layers.N.<kind>`)."""
    layer, _, rest = name.removeprefix("layers.").partition(".")
    for suffix, pattern in _KINDS:
        if suffix.search(rest):
            return layer, pattern
    raise ValueError(f"{name}: dgemma quantizes no module of this kind")


def _layers_by_kind(modules: list[str]) -> dict[str, set[str]]:
    """The layers (indices) each kind of module (its pattern) is found on, among `modules` (ours)."""
    out: dict[str, set[str]] = {}
    for name in modules:
        layer, pattern = _kind(name)
        out.setdefault(pattern, set()).add(layer)
    return out


def _targets(modules: list[str], everywhere: dict[str, set[str]]) -> list[str]:
    """Patterns (`re:`, matched from the start) for the modules of one config group: a kind on every
    layer when the group holds all of its layers (`everywhere`: every group's), else the kind on each
    of its layers. They match the checkpoint's names (`model.decoder.layers.N.self_attn.q_proj`) and
    vLLM's fused modules and shards (`model.layers.N.self_attn.qkv_proj`, its `v_proj` on global layers
    too)."""
    out = []
    for pattern, layers in sorted(_layers_by_kind(modules).items()):
        if layers == everywhere[pattern]:
            out.append(rf"re:{_LAYERS}\d+\.{pattern}$")
        else:
            out += [rf"re:{_LAYERS}{n}\.{pattern}$" for n in sorted(layers, key=int)]
    return out


def _ignored(tensors: dict[str, torch.Tensor], members: dict[QuantSpec, list[str]]) -> list[str]:
    """Every other module with a weight (norms too: tools that match targets on tensor names, not module
    classes, would take any `<m>.weight` for a Linear), lm_head (tied), and patterns for the modules
    never quantized (_IGNORED)."""
    quantized = {hf_name(m) for ms in members.values() for m in ms}
    plain = {hf.rpartition(".")[0] for hf in tensors if hf.endswith(".weight")}
    plain = {m for m in plain if not any(m.startswith(q + ".") or m == q for q in quantized)}
    return [*sorted(plain), "lm_head", *_IGNORED]


def quantization_config(members: dict[QuantSpec, list[str]], ignore: list[str], w4a4: bool = False) -> dict:
    """The `quantization_config` of config.json for modules (our names) stored as their spec: one config
    group each; with one group it targets every Linear, with several, patterns (_targets)."""
    groups, formats = {}, set()
    everywhere = _layers_by_kind([m for ms in members.values() for m in ms]) if len(members) > 1 else {}
    for i, (spec, modules) in enumerate(members.items()):
        weights, inputs, fmt = _weights_args(spec, w4a4)
        targets = ["Linear"] if len(members) == 1 else _targets(modules, everywhere)
        groups[f"group_{i}"] = {"targets": targets, "weights": weights, "input_activations": inputs, "format": fmt}
        formats.add(fmt)
    return {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": groups,
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
