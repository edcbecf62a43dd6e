"""compressed-tensors checkpoints against the compressed-tensors library (0.20.0) itself.

Tiny checkpoints are written with the library's own qparam functions and compressors, in the layout
published DiffusionGemma files use (each expert a Linear of its own, gate / up / down), for FP8-dynamic,
W4A16 (symmetric and asymmetric, with the down projections per channel, as a writer at group 128 would
store them: no published DiffusionGemma file is W4A16, ../shared/reference/formats.md §1.7), W8A16
and NVFP4. dgemma loads them with the weights kept quantized; its dequantized weights equal the library's
decompression bit for bit (fp32 and bf16 sources), and its logits equal those of the model the
library's dequantized weights make, to fp32 rounding.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import fp32_logit_tolerance
from safetensors.torch import load_file, save_file

import dgemma
from dgemma.quant import QuantExperts, QuantLinear, QuantSpec, dequantize

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import BaseCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402

DEC = "model.decoder."
IGNORE = ["lm_head", "re:.*router.*", "re:.*self_conditioning.*", "re:.*embed.*"]


def _scheme(name: str, targets: list[str], **weights) -> QuantizationScheme:
    scheme = preset_name_to_scheme(name, targets)
    for key, value in weights.items():
        setattr(scheme.weights, key, value)
    return scheme


# name -> config groups in priority order (first matching), in the layouts llm-compressor writes
SCHEMES = {
    "fp8_dynamic": [_scheme("FP8_DYNAMIC", ["Linear"])],
    "w4a16": [
        _scheme("W4A16", ["re:.*down_proj$"], strategy="channel", group_size=None),  # 704 / 2112 wide inputs
        _scheme("W4A16", ["Linear"], group_size=16),
    ],
    "w4a16_asym": [_scheme("W4A16_ASYM", ["Linear"], group_size=32)],
    "w8a16": [_scheme("W8A16", ["Linear"], strategy="channel", group_size=None)],
    "w8a16_group_asym": [_scheme("W8A16", ["Linear"], group_size=32, symmetric=False)],  # dequantized on load
    "nvfp4": [_scheme("NVFP4", ["Linear"])],
}
KEPT = {"fp8_dynamic": "fp8", "w4a16": "int4", "w4a16_asym": "int4", "w8a16": "int8", "nvfp4": "nvfp4"}
DENSE = {"w8a16_group_asym"}  # no dgemma format holds these: dequantized as the library computes them


def _format(scheme: QuantizationScheme) -> str:
    from compressed_tensors.compressors.format import infer_module_format

    return str(infer_module_format(torch.nn.Linear, scheme).value)


def _compress(w: torch.Tensor, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """One Linear's weight compressed by the library: its observer-free qparams, then its compressor."""
    args = scheme.weights
    strategy = str(args.strategy.value if hasattr(args.strategy, "value") else args.strategy)
    if strategy in ("group", "tensor_group"):
        grouped = w.reshape(w.shape[0], -1, args.group_size)
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    elif strategy == "channel":
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    state = {"weight": w}
    g = None
    if strategy == "tensor_group":
        g = generate_gparam(w.amin(), w.amax())
        state["weight_global_scale"] = g
    scale, zp = calculate_qparams(lo, hi, args, global_scale=g)
    state["weight_scale"] = scale
    if not args.symmetric:
        state["weight_zero_point"] = zp.to(torch.int8)
    compressor = BaseCompressor.get_value_from_registry(_format(scheme))
    return dict(compressor.compress(state, scheme))


def _decompress(tensors: dict[str, torch.Tensor], scheme: QuantizationScheme, dtype=None) -> torch.Tensor:
    """The library's dense weight of one compressed Linear (its decompressor; for NVFP4 in `dtype` too,
    through the same library functions with that dtype in place of its fixed bf16)."""
    if dtype is not None and _format(scheme) == "nvfp4-pack-quantized":
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

        packed = tensors["weight_packed"]
        values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=dtype)
        return ct_dequantize(
            values, tensors["weight_scale"].to(dtype), args=scheme.weights,
            global_scale=tensors["weight_global_scale"], dtype=dtype,
        )  # fmt: skip
    compressor = BaseCompressor.get_value_from_registry(_format(scheme))
    return compressor.decompress(dict(tensors), scheme)["weight"]


def _linears(tensors: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """The checkpoint's Linear weights by module name, the experts split one Linear each (gate rows first)."""
    out = {}
    inter = config.text_config.moe_intermediate_size
    for name, t in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            root = name.removesuffix(".gate_up_proj")
            for e in range(t.shape[0]):
                out[f"{root}.{e}.gate_proj"], out[f"{root}.{e}.up_proj"] = t[e, :inter], t[e, inter:]
        elif name.endswith("experts.down_proj"):
            root = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{root}.{e}.down_proj"] = t[e]
        elif name.endswith("_proj.weight") and ".layers." in name and "router" not in name:
            out[name.removesuffix(".weight")] = t
    return out


def _scheme_of(module: str, groups: list[QuantizationScheme]) -> QuantizationScheme:
    for scheme in groups:
        if any(t == "Linear" or re.match(t[3:], module) for t in scheme.targets):
            return scheme
    raise AssertionError(module)


def write_compressed(src, dst, name: str, dtype: torch.dtype = torch.float32) -> dict:
    """Write a compressed-tensors copy of the dgemma checkpoint `src` at `dst` with the library; returns
    {module: (its compressed tensors, its scheme)}."""
    groups = SCHEMES[name]
    config = dgemma.DiffusionGemmaConfig.from_file(src)
    tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in load_file(src / "model.safetensors").items()}
    linears = _linears(tensors, config)
    fused = ("experts.gate_up_proj", "experts.down_proj")
    out = {k: v for k, v in tensors.items() if k.removesuffix(".weight") not in linears and not k.endswith(fused)}
    modules = {}
    for module, w in linears.items():
        scheme = _scheme_of(module, groups)
        compressed = _compress(w.contiguous(), scheme)
        modules[module] = (compressed, scheme)
        out.update({f"{module}.{local}": t.contiguous() for local, t in compressed.items()})
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    qc = QuantizationConfig(
        config_groups={f"group_{i}": s for i, s in enumerate(groups)},
        ignore=IGNORE,
        format="mixed-precision" if len({_format(s) for s in groups}) > 1 else _format(groups[0]),
        quantization_status="compressed",
    )
    raw["quantization_config"] = qc.model_dump(mode="json") | {"quant_method": "compressed-tensors"}
    (dst / "config.json").write_text(json.dumps(raw))
    return modules


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("ct") / "src"
    dgemma.save(dgemma.build(dgemma.preset("tiny"), seed=0), path)
    return path


def _ours(model, module: str, dtype: torch.dtype) -> torch.Tensor:
    """dgemma's dequantized weight of a checkpoint module (an expert's gate / up / down included)."""
    name = module.removeprefix(DEC)
    if ".experts." in name:
        root, e, part = name.rsplit(".", 2)
        stack = model.get_submodule(root)
        which = "down_proj" if part == "down_proj" else "gate_up_proj"
        if isinstance(stack, QuantExperts):
            w = stack.expert(which, int(e), dtype)
        else:
            w = getattr(stack, which)[int(e)].to(dtype)
        half = w.shape[0] // 2
        return w if part == "down_proj" else (w[:half] if part == "gate_proj" else w[half:])
    layer = model.get_submodule(name)
    return dequantize(layer.quantized(), dtype) if isinstance(layer, QuantLinear) else layer.weight.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_weights_stay_quantized_and_dequantize_as_the_library_does(source, tmp_path, name, dtype):
    modules = write_compressed(source, tmp_path / name, name, dtype)
    model = dgemma.load(tmp_path / name, dtype=dtype)
    kept = {m.mode for m in model.modules() if isinstance(m, QuantLinear | QuantExperts)}
    assert kept == (set() if name in DENSE else {KEPT[name]})
    assert type(model.layers[0].router.proj) is torch.nn.Linear  # the ignore list and the policy
    assert name in DENSE or model.quantization["mode"] == "per-module"
    for module, (compressed, scheme) in modules.items():
        theirs = _decompress(compressed, scheme)
        ours = _ours(model, module, theirs.dtype)
        assert torch.equal(ours, theirs), module
    if name == "w4a16":  # gate_up per group, down per channel: one stack, two specs
        specs = model.layers[0].experts.specs
        assert specs["gate_up_proj"].group_size == 16 and specs["down_proj"].group_size is None


@torch.no_grad()
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_logits_equal_the_library_dequantized_model(source, tmp_path, name):
    modules = write_compressed(source, tmp_path / name, name)
    model = dgemma.load(tmp_path / name)
    # the dense model the library's decompression makes (fp32), written back in the fused layout
    dense = dgemma.load(source)
    for module, (compressed, scheme) in modules.items():
        w = _decompress(compressed, scheme, torch.float32).float()
        name_ = module.removeprefix(DEC)
        if ".experts." in name_:
            root, e, part = name_.rsplit(".", 2)
            experts = dense.get_submodule(root)
            inter = experts.down_proj.shape[-1]
            if part == "down_proj":
                experts.down_proj[int(e)] = w
            else:
                experts.gate_up_proj[int(e), slice(0, inter) if part == "gate_proj" else slice(inter, None)] = w
        else:
            dense.get_submodule(name_).weight.copy_(w)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (2, 12), generator=g)
    canvas = torch.randint(0, 500, (2, model.config.canvas_length), generator=g)
    logits = []
    for m in (model, dense):
        cache = m.new_cache(2, 12 + model.config.canvas_length)
        m.encode(ids, cache)
        logits.append(m.denoise(canvas, cache))
    # the same weights in fp32; only the experts' order of summation differs (one expert at a time)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=fp32_logit_tolerance(dense))
    assert not torch.equal(logits[1], dgemma_logits(source, ids, canvas))  # the quantization did change them


def dgemma_logits(path, ids, canvas) -> torch.Tensor:
    model = dgemma.load(path)
    cache = model.new_cache(ids.shape[0], ids.shape[1] + canvas.shape[1])
    model.encode(ids, cache)
    return model.denoise(canvas, cache)


@pytest.mark.parametrize("shape", [(48, 64), (3, 40, 32)])  # a Linear, and a stack of experts
def test_nvfp4_quantizes_to_the_library_s_bytes(shape):
    from dgemma.quant.formats import quantize_nvfp4

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, shape[-1])
    w[..., 0, :16] = 0  # an all-zero block: its scale is the smallest e4m3 step
    ours = quantize_nvfp4(w)
    scheme = SCHEMES["nvfp4"][0]
    flat = [t.reshape(-1, *t.shape[-2:]) for t in (ours.codes, ours.scales, ours.global_scale)]
    for i, m in enumerate(w.reshape(-1, *shape[-2:])):
        theirs = _compress(m, scheme)
        assert torch.equal(flat[0][i], theirs["weight_packed"])
        assert torch.equal(flat[1][i].view(torch.uint8), theirs["weight_scale"].view(torch.uint8))
        assert torch.equal(flat[2][i][0], theirs["weight_global_scale"])


def test_a_loaded_file_saves_and_reloads_as_it_is(source, tmp_path):
    write_compressed(source, tmp_path / "ct", "w4a16")
    model = dgemma.load(tmp_path / "ct")
    dgemma.save(model, tmp_path / "again")
    again = dgemma.load(tmp_path / "again")
    assert again.quantization == model.quantization
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_experts_stored_on_the_encoder_side_too(source, tmp_path):
    """Files may quantize the experts under model.encoder.language_model as well: tied copies, checked."""
    write_compressed(source, tmp_path / "ct", "nvfp4")
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    enc = "model.encoder.language_model."
    copies = {enc + k.removeprefix(DEC): v.clone() for k, v in tensors.items() if ".experts." in k}
    save_file(tensors | copies, tmp_path / "ct" / "model.safetensors")
    reference = dgemma.load(tmp_path / "ct")
    assert torch.equal(
        reference.layers[0].experts.gate_up_proj, dgemma.load(tmp_path / "ct").layers[0].experts.gate_up_proj
    )
    first = next(k for k in copies if k.endswith("weight_packed"))
    copies[first] = copies[first] ^ 1  # one code differs between the two sides
    save_file(tensors | copies, tmp_path / "ct" / "model.safetensors")
    with pytest.raises(ValueError, match="tied copy"):
        dgemma.load(tmp_path / "ct")


def _edit(path, config=None, tensors=None):
    if config:
        raw = json.loads((path / "config.json").read_text())
        config(raw["quantization_config"])
        (path / "config.json").write_text(json.dumps(raw))
    if tensors:
        t = load_file(path / "model.safetensors")
        tensors(t)
        save_file(t, path / "model.safetensors")


def test_what_dgemma_cannot_run_is_refused_by_name(source, tmp_path):
    cases = {
        "kv_cache_scheme": (lambda qc: qc.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), None),
        "format 'mxfp4": (lambda qc: qc.update(format="mxfp4-pack-quantized"), None),
        "no group": (lambda qc: qc.update(ignore=["re:.*q_proj"]), None),
        "static activation": (None, lambda t: t.update({f"{DEC}layers.0.self_attn.q_proj.input_scale": torch.ones(1)})),
        "experts": (None, lambda t: [t.pop(k) for k in [k for k in t if ".experts.3." in k]]),
    }
    for i, (message, (config, tensors)) in enumerate(cases.items()):
        path = tmp_path / str(i)
        write_compressed(source, path, "fp8_dynamic")
        _edit(path, config, tensors)
        with pytest.raises(ValueError, match=message):
            dgemma.load(path)


def test_nvfp4_activation_scales_are_reported_unused(source, tmp_path):
    write_compressed(source, tmp_path / "ct", "nvfp4")
    _edit(
        tmp_path / "ct",
        tensors=lambda t: t.update({f"{DEC}layers.0.self_attn.q_proj.input_global_scale": torch.ones(1)}),
    )
    with pytest.warns(UserWarning, match="W4A16"):
        dgemma.load(tmp_path / "ct")


EXPORTS = {
    "fp8": QuantSpec.of("fp8"),
    "int8": QuantSpec.of("int8"),
    "int4": QuantSpec.of("int4", 32, "symmetric"),
    "int4-channel": QuantSpec("int4", None, "symmetric"),
    "nvfp4": QuantSpec.of("nvfp4"),
}


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_exports_decompress_in_the_library_to_dgemma_s_weights(source, tmp_path, name):
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer

    from dgemma.checkpoints.compressed_tensors import decompressed_dtype

    model = dgemma.load(source, quant=EXPORTS[name])
    dgemma.save(model, tmp_path / "ct", format="compressed-tensors")
    raw = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert "quantization" not in raw
    QuantizationConfig.model_validate(raw["quantization_config"])  # the library parses our config
    dense = CompressedTensorsDequantizer(tmp_path / "ct", dtype=torch.float32).validate(
        load_file(tmp_path / "ct" / "model.safetensors")
    )  # every quantized tensor consumed: validate raises on leftovers
    ignored = set(raw["quantization_config"]["ignore"])
    assert {k.removesuffix(".weight") for k in dense if k.endswith(".weight")} - ignored == set(_linears_of(model))
    for module in _linears_of(model):
        q = _quantized_of(model, module)
        assert torch.equal(dense[f"{module}.weight"], dequantize(q, decompressed_dtype(q)).float()), module
    again = dgemma.load(tmp_path / "ct")  # and dgemma reads its own export back, bit for bit
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def _linears_of(model) -> list[str]:
    out = []
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            out.append(DEC + name)
        elif isinstance(m, QuantExperts):
            out += [f"{DEC}{name}.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    return out


def _quantized_of(model, module: str):
    from dgemma.checkpoints.vllm_export import _split_rows

    name = module.removeprefix(DEC)
    if ".experts." not in name:
        return model.get_submodule(name).quantized()
    root, e, part = name.rsplit(".", 2)
    stack = model.get_submodule(root)
    if part == "down_proj":
        return stack.quantized("down_proj", int(e))
    q = stack.quantized("gate_up_proj", int(e))
    half = q.shape[0] // 2
    return _split_rows(q, slice(0, half) if part == "gate_proj" else slice(half, None))


def test_exports_refuse_what_compressed_tensors_cannot_hold(source, tmp_path):
    with pytest.raises(ValueError, match="no quantized weights"):
        dgemma.save(dgemma.load(source), tmp_path / "a", format="compressed-tensors")
    with pytest.raises(ValueError, match="own int4"):
        dgemma.save(dgemma.load(source, quant="int4", group_size=16), tmp_path / "b", format="compressed-tensors")


def test_the_quantize_command_writes_what_vllm_serves(source, tmp_path, capsys):
    from compressed_tensors.entrypoints.convert import CompressedTensorsDequantizer
    from helpers import make_tokenizer

    from dgemma.cli import main

    make_tokenizer(512).save(tmp_path / "src")
    for f in source.iterdir():
        (tmp_path / "src" / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "w4a16"
    args = ["quantize", str(tmp_path / "src"), str(out), "--quant", "int4", "--group-size", "32"]
    assert main([*args, "--format", "compressed-tensors", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "compressed-tensors"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"] | {"targets": qc["config_groups"]["group_0"]["targets"]} == {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, "targets": ["Linear"],
    }  # fmt: skip
    CompressedTensorsDequantizer(out).validate(load_file(out / "model.safetensors"))
    assert (out / "tokenizer.json").is_file()
    assert main(["generate", "-m", str(out), "-p", "a", "--max-new-tokens", "4", "--seed", "0"]) == 0
    capsys.readouterr()
    assert main(["quantize", str(tmp_path / "src"), str(tmp_path / "x"), "--format", "compressed-tensors"]) == 2
    assert "--quant" in capsys.readouterr().err


def test_a_malformed_quantization_config_is_a_clear_error(source, tmp_path):
    write_compressed(source, tmp_path / "ct", "fp8_dynamic")
    _edit(tmp_path / "ct", config=lambda qc: qc["config_groups"]["group_0"]["weights"].pop("type"))
    with pytest.raises(ValueError, match="quantization_config"):
        dgemma.load(tmp_path / "ct")


Q = f"{DEC}layers.0.self_attn.q_proj"
EXPERT = f"{DEC}layers.0.experts.1.gate_proj"


def _replace(name: str, value: torch.Tensor):
    return lambda t: t.update({name: value})


# (scheme, edit of the file's tensors, the error) for files the library wrote, then damaged
HOSTILE = {
    "no scale, fp8": ("fp8_dynamic", lambda t: t.pop(f"{Q}.weight_scale"), rf"{Q}\.weight holds F8_E4M3 codes"),
    "no scale, expert": ("fp8_dynamic", lambda t: t.pop(f"{EXPERT}.weight_scale"), "experts.1.gate_proj.weight hol"),
    "no scale, int4": ("w4a16", lambda t: t.pop(f"{Q}.weight_scale"), rf"{Q}: config says int4 .* no weight_scale$"),
    "no zero point": ("w4a16_asym", lambda t: t.pop(f"{Q}.weight_zero_point"), "no weight_zero_point"),
    "no global scale": ("nvfp4", lambda t: t.pop(f"{Q}.weight_global_scale"), "no weight_global_scale"),
    "no weight_shape": ("w8a16", lambda t: t.pop(f"{Q}.weight_shape"), "int8 per channel .* no weight_shape"),
    "scale rows": ("fp8_dynamic", _replace(f"{EXPERT}.weight_scale", torch.ones(5, 1)), r"32 values .* \(5, 1\)"),
    "scale groups": ("w4a16", _replace(f"{Q}.weight_scale", torch.ones(64, 2)), r"\(64, 4\) .* \(64, 2\)"),
    "nvfp4 scale": ("nvfp4", _replace(f"{Q}.weight_scale", torch.ones(3, 2).to(torch.float8_e4m3fn)), r"\(3, 2\)"),
    "zero points": ("w4a16_asym", _replace(f"{Q}.weight_zero_point", torch.zeros(8, 3, dtype=torch.int32)), "zero_p"),
    "global scales": ("nvfp4", _replace(f"{Q}.weight_global_scale", torch.ones(2)), "1 values"),
    "expert shapes": (
        "fp8_dynamic",
        lambda t: t.update(
            {f"{EXPERT}.weight": t[f"{EXPERT}.weight"][:16], f"{EXPERT}.weight_scale": torch.ones(16, 1)}
        ),
        "experts' gate_up_proj weights differ in shape",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_missing_or_misshapen_quantization_tensors_name_the_module(source, tmp_path, case):
    name, edit, message = HOSTILE[case]
    write_compressed(source, tmp_path / "ct", name)
    _edit(tmp_path / "ct", tensors=edit)
    with pytest.raises(ValueError, match=message):
        dgemma.load(tmp_path / "ct")


def test_codes_of_another_dtype_than_the_config_says_are_refused(source, tmp_path):
    """An int8 config over FP8 codes would load and then fail in the int8 kernel (use_kernels)."""

    def int8(qc):
        qc["format"] = qc["config_groups"]["group_0"]["format"] = "int-quantized"
        qc["config_groups"]["group_0"]["weights"]["type"] = "int"

    write_compressed(source, tmp_path / "ct", "fp8_dynamic")
    _edit(tmp_path / "ct", config=int8)
    with pytest.raises(ValueError, match=r"config says int8 per channel \(int-quantized\) but weight is F8_E4M3"):
        dgemma.load(tmp_path / "ct")


@pytest.mark.parametrize(
    "name, tensor, value",
    [
        ("fp8_dynamic", f"{Q}.weight_scale", float("inf")),
        ("fp8_dynamic", f"{EXPERT}.weight_scale", float("nan")),
        ("w4a16", f"{Q}.weight_scale", float("-inf")),
        ("w8a16_group_asym", f"{Q}.weight_scale", float("nan")),  # dequantized on load
        ("nvfp4", f"{Q}.weight_scale", float("nan")),  # e4m3: no inf
        ("nvfp4", f"{Q}.weight_global_scale", float("inf")),
        ("nvfp4", f"{EXPERT}.weight_global_scale", float("nan")),
    ],
)
def test_non_finite_scales_are_refused(source, tmp_path, name, tensor, value):
    def poison(t):
        x = t[tensor].float().clone()
        x.view(-1)[-1] = value
        t[tensor] = x.to(t[tensor].dtype)

    write_compressed(source, tmp_path / "ct", name)
    _edit(tmp_path / "ct", tensors=poison)
    with pytest.raises(ValueError, match=rf"^{re.escape(tensor)} holds non-finite"):
        dgemma.load(tmp_path / "ct")
