"""Every compressed-tensors export walked through what vLLM's loader expects (tests/vllm_static.py, written
from vLLM 0.34.0's source): its config, scheme selection, fused modules (a global layer's qkv_proj has no
v_proj), expert schemes and parameter names, dtypes and shapes; and the checker itself catches what the
exports used to get wrong. Two geometries: a random tiny model whose every input is a multiple of 128
(int4 group 128 fits), and a transformers-written checkpoint with a vision tower."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import vllm_static

import dgemma
from dgemma.quant import QuantExperts, QuantSpec, swap_modules
from dgemma.quant.calibrate import calibration_batches, input_amax

EXPORTS = {  # name -> (spec, W4A4, vLLM's scheme of every quantized module)
    "fp8": (QuantSpec.of("fp8"), False, "W8A8Fp8"),
    "int4-g32": (QuantSpec.of("int4", 32, "symmetric"), False, "WNA16"),
    "int4-g64": (QuantSpec.of("int4", 64, "symmetric"), False, "WNA16"),
    "int4-g128": (QuantSpec.of("int4", 128, "symmetric"), False, "WNA16"),
    "int4-channel": (QuantSpec("int4", None, "symmetric"), False, "WNA16"),
    "int8": (QuantSpec.of("int8"), False, "WNA16"),
    "nvfp4": (QuantSpec.of("nvfp4"), False, "W4A16Fp4"),
    "nvfp4-w4a4": (QuantSpec.of("nvfp4"), True, "W4A4Fp4"),
}


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A random tiny model whose inputs (hidden 128, heads x head_dim 128 / 256, intermediate 256, experts'
    128) every Marlin group size divides."""
    tiny = dgemma.preset("tiny")
    text = dataclasses.replace(
        tiny.text_config, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32,
        global_head_dim=64,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("wide") / "src"
    dgemma.save(dgemma.build(dataclasses.replace(tiny, text_config=text), seed=0), path)
    return path


def _amax(model) -> dict[str, torch.Tensor]:
    """Calibrated input ranges on random tokens (every expert reached or filled from its layer)."""
    ids = torch.randint(3, 500, (8 * (16 + model.config.canvas_length),), generator=torch.Generator().manual_seed(0))
    batches = calibration_batches(
        ids.tolist(), batch_size=4, prompt_length=16, canvas_length=model.config.canvas_length, batches=2
    )
    return input_amax(model, batches, 16)


def _export(src, dst, spec: QuantSpec, w4a4: bool):
    model = dgemma.load(src, quant=spec)
    dgemma.save(model, dst, format="compressed-tensors", input_ranges=_amax(model) if w4a4 else None)
    return model


@pytest.mark.parametrize("name", sorted(EXPORTS))
def test_every_export_loads_as_vllm_reads_it(wide, tmp_path, name):
    spec, w4a4, scheme = EXPORTS[name]
    model = _export(wide, tmp_path / name, spec, w4a4)
    schemes = vllm_static.load(tmp_path / name)
    assert set(schemes.values()) == {scheme}
    assert len(schemes) == 6 * 5  # every layer: qkv, o, gate_up, down, experts
    qc = json.loads((tmp_path / name / "config.json").read_text())["quantization_config"]
    if spec.mode in ("int8",) or (spec.mode == "int4" and spec.group_size is None):
        assert qc["config_groups"]["group_0"]["weights"]["group_size"] == -1
    again = dgemma.load(tmp_path / name)  # and dgemma reads it back as it was
    a, b = model.state_dict(), again.state_dict()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_nvfp4_fused_groups_share_one_global_scale(wide, tmp_path):
    from safetensors.torch import load_file

    _export(wide, tmp_path / "nv", QuantSpec.of("nvfp4"), True)
    t = load_file(tmp_path / "nv" / "model.safetensors")
    for layer in range(6):
        p = f"model.decoder.layers.{layer}."
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            names = [f"{p}{'self_attn' if 'q_proj' in group else 'mlp'}.{m}" for m in group]
            names = [n for n in names if f"{n}.weight_global_scale" in t]  # global layers: no v_proj
            assert len(names) == (2 if layer == 5 and "q_proj" in group else len(group))
            for key in ("weight_global_scale", "input_global_scale"):
                assert len({float(t[f"{n}.{key}"]) for n in names}) == 1, (names, key)


def test_a_mixed_export_targets_fused_modules_and_one_scheme_per_expert(wide, tmp_path):
    model = dgemma.load(wide)
    g32, g64, channel = (QuantSpec("int4", g, "symmetric") for g in (32, 64, None))
    specs = {}
    for i in range(6):
        p = f"layers.{i}."
        specs |= {p + f"self_attn.{m}": g32 for m in ("q_proj", "k_proj", "v_proj") if i != 5 or m != "v_proj"}
        specs |= {p + "self_attn.o_proj": QuantSpec.of("fp8"), p + "mlp.gate_proj": QuantSpec.of("int8")}
        specs |= {p + "mlp.up_proj": QuantSpec.of("int8"), p + "mlp.down_proj": channel if i % 2 else g64}
    swap_modules(model, specs)
    for layer in model.layers:  # experts stored as published files read in: gate/up per group, down per channel
        e, two_i, h = layer.experts.gate_up_proj.shape
        experts = QuantExperts(e, h, two_i // 2, g64, channel)
        experts.set_weight("gate_up_proj", layer.experts.gate_up_proj.detach())
        experts.set_weight("down_proj", layer.experts.down_proj.detach())
        layer.experts = experts
    dgemma.save(model, tmp_path / "mixed", format="compressed-tensors")
    schemes = vllm_static.load(tmp_path / "mixed")
    assert schemes["model.layers.5.self_attn.qkv_proj"] == "WNA16"  # a global layer: q and k only
    assert schemes["model.layers.0.self_attn.o_proj"] == "W8A8Fp8" and schemes["model.layers.0.experts"] == "WNA16"
    qc = json.loads((tmp_path / "mixed" / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "mixed-precision"
    assert all(t.startswith("re:") for g in qc["config_groups"].values() for t in g["targets"])
    again = dgemma.load(tmp_path / "mixed")  # the experts under one group size of 64: the same weights
    for i in range(6):
        ours, theirs = model.layers[i].experts, again.layers[i].experts
        assert theirs.specs["down_proj"] == g64
        for which in ("gate_up_proj", "down_proj"):
            assert torch.equal(ours.expert(which, 1, torch.float32), theirs.expert(which, 1, torch.float32))


def test_a_transformers_checkpoint_with_a_vision_tower(moe_ckpt, tmp_path):
    """The second geometry, with a vision tower vLLM would quantize under a "Linear" target unless ignored."""
    model = dgemma.load(moe_ckpt[0], quant=QuantSpec.of("nvfp4"))
    assert model.vision_tower is not None
    dgemma.save(model, tmp_path / "nv", format="compressed-tensors")
    assert set(vllm_static.load(tmp_path / "nv").values()) == {"W4A16Fp4"}


def test_the_checker_catches_what_exports_used_to_get_wrong(wide, tmp_path):
    """Without these fixes an export fails the walk: exact-name targets (a global layer's qkv_proj
    matches none), unshared NVFP4 global scales, int4 groups Marlin lacks, per_layer_config only."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "x"
    model = dgemma.load(wide)
    swap_modules(model, {f"layers.{i}.self_attn.o_proj": QuantSpec.of("fp8") for i in range(6)})
    qkv = [
        f"layers.{i}.self_attn.{m}" for i in range(6) for m in ("q_proj", "k_proj", "v_proj") if i < 5 or m != "v_proj"
    ]
    swap_modules(model, dict.fromkeys(qkv, QuantSpec.of("int8")))
    dgemma.save(model, out, format="compressed-tensors")
    raw = json.loads((out / "config.json").read_text())
    for group in raw["quantization_config"]["config_groups"].values():  # exact module names, as before
        fp8 = group["weights"]["type"] == "float"
        group["targets"] = (
            [f"model.decoder.layers.{i}.self_attn.o_proj" for i in range(6)]
            if fp8
            else [f"model.decoder.{m}" for m in qkv]
        )
    (out / "config.json").write_text(json.dumps(raw))
    with pytest.raises(vllm_static.Refused, match=r"layers\.5\.self_attn\.qkv_proj is left unquantized"):
        vllm_static.load(out)

    _export(wide, tmp_path / "nv", QuantSpec.of("nvfp4"), False)
    t = load_file(tmp_path / "nv" / "model.safetensors")
    t["model.decoder.layers.0.self_attn.k_proj.weight_global_scale"] *= 2
    save_file(t, tmp_path / "nv" / "model.safetensors")
    with pytest.raises(vllm_static.Refused, match="different for parallel layers"):
        vllm_static.load(tmp_path / "nv")

    raw = json.loads((tmp_path / "nv" / "config.json").read_text())
    text = raw["text_config"]
    per = {"head_dim": text.pop("global_head_dim"), "num_key_value_heads": text.pop("num_global_key_value_heads")}
    text["per_layer_config"] = {"5": per}
    assert dgemma.DiffusionGemmaConfig.from_dict(raw).text_config.global_head_dim == 64  # dgemma reads both


def test_exports_refuse_what_vllm_cannot_run(wide, tmp_path):
    from dgemma.checkpoints.vllm_export import check_spec

    with pytest.raises(ValueError, match="Marlin kernels take groups of 32, 64, 128"):
        check_spec(QuantSpec.of("int4", 16, "symmetric"))
    model = dgemma.load(wide, quant=QuantSpec.of("int4", 16, "symmetric"))
    with pytest.raises(ValueError, match="--group-size 32, 64 or 128"):
        dgemma.save(model, tmp_path / "g16", format="compressed-tensors")
    model = dgemma.load(wide, quant="int8")
    model.layers[0].self_attn.k_proj = dgemma.load(wide, quant="fp8").layers[0].self_attn.k_proj
    with pytest.raises(ValueError, match="as one matmul under one scheme"):
        dgemma.save(model, tmp_path / "qkv", format="compressed-tensors")
    with pytest.raises(ValueError, match="W4A4"):
        dgemma.save(dgemma.load(wide, quant="int8"), tmp_path / "a", format="compressed-tensors", input_ranges={})
    with pytest.raises(ValueError, match=r"no calibrated input range for layers\.0\.self_attn\.q_proj"):
        dgemma.save(dgemma.load(wide, quant="nvfp4"), tmp_path / "b", format="compressed-tensors", input_ranges={})
    with pytest.raises(ValueError, match="compressed-tensors format only"):
        dgemma.save(dgemma.load(wide, quant="nvfp4"), tmp_path / "c", input_ranges={})


def test_the_quantize_command_hands_off_to_vllm(wide, tmp_path, capsys):
    """`dgemma quantize --format compressed-tensors`: says which vLLM path each export takes, refuses
    group sizes Marlin lacks before reading anything, copies the processor files and chat template, and
    with --calibrate writes a W4A4 NVFP4 file the walk accepts."""
    from helpers import make_tokenizer

    from dgemma.cli import main

    src = tmp_path / "src"
    make_tokenizer(512).save(src)
    for f in wide.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    side = {"processor_config.json": "{}", "preprocessor_config.json": '{"patch_size": 16}', "chat_template.jinja": "x"}
    for name, body in side.items():
        (src / name).write_text(body)
    words = " ".join(f"word{i % 97} and some text, {i}." for i in range(600))
    (tmp_path / "calibration.jsonl").write_text("\n".join(json.dumps({"text": words[i::3]}) for i in range(3)))

    def run(*extra: str) -> int:
        return main(["quantize", str(src), *extra, "--format", "compressed-tensors", "--json", "--force"])

    assert run(str(tmp_path / "w4a4"), "--quant", "nvfp4", "--calibrate", str(tmp_path / "calibration.jsonl"),
               "--calibration-samples", "4") == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert "W4A4Fp4" in report["vllm"]
    assert set(vllm_static.load(tmp_path / "w4a4").values()) == {"W4A4Fp4"}
    assert all((tmp_path / "w4a4" / name).read_text() == body for name, body in side.items())
    assert run(str(tmp_path / "int4"), "--quant", "int4", "--group-size", "128") == 0
    assert "WNA16" in json.loads(capsys.readouterr().out)["vllm"]
    assert run(str(tmp_path / "g16"), "--quant", "int4", "--group-size", "16") == 2
    assert "32, 64 or 128" in capsys.readouterr().err and not (tmp_path / "g16").exists()
    assert run(str(tmp_path / "c"), "--quant", "int8", "--calibrate", str(tmp_path / "calibration.jsonl")) == 2
    assert "--calibrate writes NVFP4 W4A4" in capsys.readouterr().err
    (tmp_path / "short.txt").write_text("too short")
    assert run(str(tmp_path / "s"), "--quant", "nvfp4", "--calibrate", str(tmp_path / "short.txt")) == 2
    assert "the calibration text has" in capsys.readouterr().err
