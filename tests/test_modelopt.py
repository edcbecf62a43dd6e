"""NVIDIA ModelOpt NVFP4 checkpoints, read as they are, against the compressed-tensors library's converter.

A tiny file is written in ModelOpt's layout (uint8 `weight`, e4m3 `weight_scale`, fp32 scalar
`weight_scale_2`, `input_scale`; experts one Linear each; the router, embeddings and self-conditioning
excluded), from codes and scales the compressed-tensors library computes. The oracle is that library's
`ModelOptNvfp4Converter` (0.20.0): the file it converts to compressed-tensors loads into dgemma with the
same tensors, bit for bit, as the ModelOpt file itself, and the library's own decompression of the
converted file equals dgemma's dequantized weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import dgemma
from dgemma.quant import QuantExperts, QuantLinear

pytest.importorskip("compressed_tensors")
from compressed_tensors.entrypoints.convert import ModelOptNvfp4Converter
from test_compressed_tensors import SCHEMES, _compress, _decompress, _linears, _ours

EXCLUDE = ["lm_head", "*router*", "*self_conditioning*", "*embed*"]


def write_modelopt(src, dst, *, side_file: bool = False, kv_cache: bool = False) -> None:
    """The dgemma checkpoint `src` as ModelOpt writes NVFP4 (names and inverted global scales)."""
    config = dgemma.DiffusionGemmaConfig.from_file(src)
    tensors = load_file(src / "model.safetensors")
    linears = _linears(tensors, config)
    fused = ("experts.gate_up_proj", "experts.down_proj")
    out = {k: v for k, v in tensors.items() if k.removesuffix(".weight") not in linears and not k.endswith(fused)}
    g = torch.Generator().manual_seed(3)
    for module, w in linears.items():
        ct = _compress(w.contiguous(), SCHEMES["nvfp4"][0])
        out[f"{module}.weight"] = ct["weight_packed"]
        out[f"{module}.weight_scale"] = ct["weight_scale"]
        out[f"{module}.weight_scale_2"] = (1 / ct["weight_global_scale"]).reshape(())
        out[f"{module}.input_scale"] = (torch.rand((), generator=g) + 0.1) / 2688
        if kv_cache and module.endswith("k_proj"):
            out[f"{module}.k_scale"] = torch.tensor(1.0)
    dst.mkdir(parents=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    block = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": EXCLUDE}
    block["kv_cache_quant_algo"] = "FP8" if kv_cache else None
    if side_file:
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": block}))
    else:
        raw["quantization_config"] = {"quant_method": "modelopt", **block}
    (dst / "config.json").write_text(json.dumps(raw))


def convert_with_the_library(modelopt_dir, dst) -> None:
    """The ModelOpt file converted to compressed-tensors by compressed-tensors' own converter."""
    converter = ModelOptNvfp4Converter(ignore=["re:.*router.*", "re:.*self_conditioning.*"], targets=["re:.*"])
    tensors = converter.validate(load_file(modelopt_dir / "model.safetensors"))
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((modelopt_dir / "config.json").read_text())
    raw["quantization_config"] = converter.update_config(None).model_dump(mode="json") | {
        "quant_method": "compressed-tensors"
    }
    (dst / "config.json").write_text(json.dumps(raw))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("modelopt") / "src"
    dgemma.save(dgemma.build(dgemma.preset("tiny"), seed=0), path)
    return path


@pytest.mark.parametrize("side_file", [False, True], ids=["config.json", "hf_quant_config.json"])
def test_modelopt_nvfp4_loads_equal_to_its_compressed_tensors_conversion(source, tmp_path, side_file):
    write_modelopt(source, tmp_path / "modelopt", side_file=side_file)
    convert_with_the_library(tmp_path / "modelopt", tmp_path / "ct")
    with pytest.warns(UserWarning, match="activation scales"):
        ours = dgemma.load(tmp_path / "modelopt")
    with pytest.warns(UserWarning, match="activation scales"):
        converted = dgemma.load(tmp_path / "ct")
    assert {m.mode for m in ours.modules() if isinstance(m, QuantLinear | QuantExperts)} == {"nvfp4"}
    assert type(ours.layers[0].router.proj) is torch.nn.Linear
    a, b = ours.state_dict(), converted.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name].view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)), name
    # and the library's decompression of the converted file is dgemma's dequantized weight
    scheme = SCHEMES["nvfp4"][0]
    ct = load_file(tmp_path / "ct" / "model.safetensors")
    modules = {n.removesuffix(".weight_packed") for n in ct if n.endswith(".weight_packed")}
    assert any(".experts.0.gate_proj" in m for m in modules)
    for module in sorted(modules):
        local = {k.rpartition(".")[2]: v for k, v in ct.items() if k.rpartition(".")[0] == module}
        # the converter keeps ModelOpt's 0-d scalar, by which the library's decompression divides in bf16
        # (a 0-d tensor does not promote); its own compressor writes [1], divided in fp32: dgemma reads [1]
        local["weight_global_scale"] = local["weight_global_scale"].reshape(1)
        theirs = _decompress(local, scheme)
        assert torch.equal(_ours(ours, module, theirs.dtype), theirs), module


def test_modelopt_kv_cache_scales_are_reported_and_other_algorithms_refused(source, tmp_path):
    write_modelopt(source, tmp_path / "kv", kv_cache=True)
    with pytest.warns(UserWarning, match="KV cache scales"):
        dgemma.load(tmp_path / "kv")
    raw = json.loads((tmp_path / "kv" / "config.json").read_text())
    for change, message in (
        ({"quant_algo": "FP8"}, "quant_algo 'FP8' is not supported"),
        ({"quant_algo": "W4A8_AWQ"}, "quant_algo 'W4A8_AWQ'"),
        ({"group_size": 32}, "NVFP4 needs group_size 16"),
    ):
        (tmp_path / "kv" / "config.json").write_text(
            json.dumps(raw | {"quantization_config": raw["quantization_config"] | change})
        )
        with pytest.raises(ValueError, match=message):
            dgemma.load(tmp_path / "kv")


def _q_proj(tensors: dict, local: str) -> str:
    """The name of layer 0's q_proj tensor `local` in a ModelOpt file."""
    return next(n for n in tensors if n.endswith(f"layers.0.self_attn.q_proj.{local}"))


# damage -> (the tensors it replaces: local name -> value, given the file's tensor of that name; the error)
HOSTILE = {
    "bf16 codes": ({"weight": lambda t: torch.zeros(64, 32, dtype=torch.bfloat16)}, "uint8"),
    "zero global scale": (
        {"weight_scale_2": lambda t: torch.tensor(0.0)},
        r"weight_scale_2 holds 0\.0; it must be > 0",
    ),
    "inf global scale": ({"weight_scale_2": lambda t: torch.tensor(float("inf"))}, "weight_scale_2 holds non-finite"),
    "negative global scale": ({"weight_scale_2": lambda t: torch.tensor(-1e-3)}, "weight_scale_2 holds -0.001"),
    "nan input scale": ({"input_scale": lambda t: torch.tensor(float("nan"))}, "input_scale holds non-finite"),
    "zero input scale": ({"input_scale": lambda t: torch.tensor(0.0)}, "input_scale holds 0.0; it must be > 0"),
    "input scale of many values": ({"input_scale": lambda t: torch.ones(4)}, r"input_scale has shape \(4,\)"),
    "zero group scales": ({"weight_scale": torch.zeros_like}, "weight_scale is all zeros"),
    "negative group scale": (
        {"weight_scale": lambda t: (-t.float()).to(t.dtype)},
        "weight_scale holds negative values",
    ),
    "nan group scale": (
        {"weight_scale": lambda t: torch.full_like(t.float(), float("nan")).to(t.dtype)},
        "weight_scale holds non-finite",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_modelopt_files_fail_at_load_naming_the_tensor(source, tmp_path, case):
    """A ModelOpt file written as ModelOpt writes it, then one tensor damaged: the load is one ValueError
    naming the file and the tensor (a scale of +inf, 0 or NaN would load as weights of 0 or NaN)."""
    write_modelopt(source, tmp_path / "good")
    tensors = load_file(tmp_path / "good" / "model.safetensors")
    edits, message = HOSTILE[case]
    changed = {(name := _q_proj(tensors, local)): damage(tensors[name]) for local, damage in edits.items()}
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors | changed, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    with pytest.raises(ValueError, match=message) as caught:
        dgemma.load(bad)
    assert "\n" not in str(caught.value) and "q_proj" in str(caught.value)


def test_an_orphan_modelopt_scale_is_refused(source, tmp_path):
    write_modelopt(source, tmp_path / "good")
    tensors = load_file(tmp_path / "good" / "model.safetensors")
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(tensors | {"model.decoder.norm.input_scale": torch.tensor(1.0)}, bad / "model.safetensors")
    (bad / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    with pytest.raises(ValueError, match="no weight_scale_2 beside it"):
        dgemma.load(bad)
