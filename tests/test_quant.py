"""Weight-only quantization: format round trips, quantized matmuls against the dequantized reference,
and a quantized model against the full-precision one."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import dgemma
from dgemma.quant import QuantExperts, QuantLinear, QuantSpec, dequantize, quantize, quantize_model, targets
from dgemma.quant.formats import pack_int4, unpack_int4


def test_int4_packing_round_trip():
    codes = torch.arange(-8, 8).repeat(3, 2)  # every code, [3, 32]
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16)
    assert torch.equal(unpack_int4(packed), codes.to(torch.int8))


@pytest.mark.parametrize(
    ("mode", "bound"), [("int8", 0.5 / 127), ("int4", 0.5 / 7.5), ("fp8", 1 / 16), ("nvfp4", 1 / 6 * 1.07)]
)
def test_round_trip_error_is_bounded(mode, bound):
    torch.manual_seed(0)
    w = torch.randn(2, 48, 128)  # a stack, as the experts are
    q = quantize(w, mode, group_size=32)
    back = dequantize(q)
    assert back.shape == w.shape
    if mode == "int4":  # half a step of each group's scale
        ref = w.reshape(2, 48, 4, 32).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 32).reshape(w.shape)
    elif mode == "nvfp4":  # half the widest e2m1 step (4 -> 6) of each 16-block's max, its e4m3 scale 3 bits
        ref = w.reshape(2, 48, 8, 16).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 16).reshape(w.shape)
    else:  # int8: half a step of the row's scale; fp8: 3 mantissa bits, relative to the row's max
        ref = w.abs().amax(-1, keepdim=True)
    err = (back - w).abs() / ref
    assert err.max() <= bound * 1.01, err.max()  # 1%: int4 scales are rounded to bf16


def test_int4_is_half_a_byte_per_weight():
    q = quantize(torch.randn(64, 256), "int4", group_size=64)
    assert q.codes.nbytes == 64 * 256 // 2 and q.scales.shape == (64, 4)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize(torch.randn(4, 8), "int3")
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.randn(4, 96), "int4", group_size=64)
    with pytest.raises(ValueError, match="matrices"):
        quantize(torch.randn(8), "int8")


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8", "nvfp4"])
def test_quant_linear_equals_the_dequantized_reference(mode, monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=False)
    x = torch.randn(5, 7, 64)
    q = QuantLinear.from_linear(linear, QuantSpec.of(mode, 32))
    reference = F.linear(x, dequantize(q.quantized()))
    torch.testing.assert_close(q(x), reference, rtol=0, atol=0)
    monkeypatch.setattr("dgemma.quant.modules.TILE_ELEMENTS", 64 * 10)  # tiles of 10 rows
    torch.testing.assert_close(q(x), reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "int4", "nvfp4"])
def test_quant_experts_equal_the_reference_on_dequantized_weights(mode):
    config = dgemma.preset("tiny")
    model = dgemma.build(config, seed=0)
    experts = model.layers[0].experts
    q = QuantExperts.from_experts(experts, QuantSpec.of(mode, 16))
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack([q.expert("gate_up_proj", e, torch.float32) for e in range(4)]))
        experts.down_proj.copy_(torch.stack([q.expert("down_proj", e, torch.float32) for e in range(4)]))
        x = torch.randn(9, config.text_config.hidden_size)
        weights, index = model.layers[0].router(x)
        torch.testing.assert_close(q(x, weights, index), experts(x, weights, index), rtol=1e-5, atol=1e-6)


def test_policy_keeps_router_norms_embeddings_and_self_conditioning():
    model = dgemma.build(dgemma.preset("tiny"), seed=0)
    names = targets(model)
    assert "layers.0.self_attn.q_proj" in names and "layers.0.experts" in names and "layers.0.mlp.down_proj" in names
    assert not any("router" in n or "embed" in n or n.startswith("self_conditioning") for n in names)


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8", "nvfp4"])
def test_quantized_model_equals_the_model_with_dequantized_weights(mode):
    """The swap is exact: a quantized model computes what the full model computes with the rounded weights.
    (How far rounding moves a *trained* model's outputs is measured by benchmarks, not here: random tiny
    models amplify any weight noise.)"""
    config = dgemma.preset("tiny")
    quantized = quantize_model(dgemma.build(config, seed=0), mode, group_size=16)
    reference = dgemma.build(config, seed=0)
    with torch.no_grad():
        for name in targets(reference):
            module, q = reference.get_submodule(name), quantized.get_submodule(name)
            if isinstance(q, QuantExperts):
                for w in ("gate_up_proj", "down_proj"):
                    getattr(module, w).copy_(torch.stack([q.expert(w, e, torch.float32) for e in range(4)]))
            else:
                module.weight.copy_(dequantize(q.quantized()))
    ids = torch.randint(0, config.text_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    canvas = torch.randint(0, config.text_config.vocab_size, (2, config.canvas_length))

    def logits(m):
        cache = m.new_cache(batch_size=2, max_length=32)
        m.encode(ids, cache)
        return m.denoise(canvas, cache)

    with torch.no_grad():
        torch.testing.assert_close(logits(quantized), logits(reference), rtol=1e-4, atol=1e-5)
    assert isinstance(quantized.layers[0].self_attn.q_proj, QuantLinear)
    assert quantized.quantization["mode"] == mode and quantized.quantization["group_size"] == (
        16 if mode == "int4" else None
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny MoE checkpoint in bf16, as the official one is stored."""
    path = tmp_path_factory.mktemp("quant") / "ckpt"
    dgemma.save(dgemma.build(dgemma.preset("tiny"), seed=0).to(torch.bfloat16), path)
    return path


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8", "nvfp4"])
def test_quantize_on_load_equals_quantize_after_load(checkpoint, mode):
    on_load = dgemma.load(checkpoint, quant=mode, group_size=16)
    after = quantize_model(dgemma.load(checkpoint), mode, group_size=16)
    a, b = on_load.state_dict(), after.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), (
            name
        )
    assert isinstance(on_load.layers[1].experts, QuantExperts)


@pytest.mark.parametrize("mode", ["int8", "int4", "fp8", "nvfp4"])
def test_saved_quantized_checkpoints_reload_identically(checkpoint, tmp_path, mode):
    model = dgemma.load(checkpoint, quant=mode, group_size=16)
    dgemma.save(model, tmp_path / "q")
    again = dgemma.load(tmp_path / "q")
    assert again.quantization == model.quantization
    a, b = model.state_dict(), again.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    size = (tmp_path / "q" / "model.safetensors").stat().st_size
    assert size < (checkpoint / "model.safetensors").stat().st_size


def test_bad_quant_names_are_rejected(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="unknown quantization 'int2'"):
        dgemma.load(checkpoint, quant="int2")
    dgemma.save(dgemma.load(checkpoint, quant="int8"), tmp_path / "q8")
    with pytest.raises(ValueError, match="already quantized as int8"):
        dgemma.load(tmp_path / "q8", quant="int4")


def test_codes_of_another_dtype_than_the_quantization_block_says_are_refused(checkpoint, tmp_path):
    """int8 codes under a block that says fp8 (the same scale shapes) would load, then fail in the fp8 kernel."""
    dgemma.save(dgemma.load(checkpoint, quant="int8"), tmp_path / "q8")
    raw = json.loads((tmp_path / "q8" / "config.json").read_text())
    raw["quantization"]["mode"] = "fp8"
    (tmp_path / "q8" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"says torch\.float8_e4m3fn codes, but they are torch\.int8"):
        dgemma.load(tmp_path / "q8")


def test_quantize_command_writes_a_checkpoint_every_command_loads(tmp_path, capsys):
    from helpers import make_tokenizer

    from dgemma.cli import main

    src = tmp_path / "src"
    config = dgemma.preset("tiny")
    dgemma.save(dgemma.build(config, seed=0), src)
    make_tokenizer(512).save(src)
    assert main(["quantize", str(src), str(tmp_path / "q4"), "--quant", "int4", "--group-size", "16"]) == 0
    assert "int4 weights" in capsys.readouterr().out
    assert (tmp_path / "q4" / "tokenizer.json").is_file()
    assert main(["generate", "-m", str(tmp_path / "q4"), "-p", "a", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert main(["generate", "-m", str(src), "--quant", "int8", "-p", "a", "--max-new-tokens", "4"]) == 0
    capsys.readouterr()
    assert main(["quantize", str(src), str(tmp_path / "q4"), "--quant", "int8"]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err
    assert main(["quantize", str(src), str(tmp_path / "x"), "--quant", "int4", "--group-size", "48"]) == 2
    assert "group_size" in capsys.readouterr().err


# Characters str.splitlines() splits at but "\n"-delimited JSON Lines may hold raw inside a string
RAW_BREAKS = "\u2028\u2029\x85"


def test_calibration_jsonl_lines_end_at_newlines_only(tmp_path):
    """A .jsonl whose texts hold U+2028, U+2029 and U+0085 raw (json.dumps writes them so) and CRLF line
    ends reads as json.loads reads it line by line, not as "line N is not JSON"."""
    from dgemma.cli.quant import _calibration_text

    texts = [f"a{RAW_BREAKS}b", "tab\tand \x0b\x0c\x1c\x1d\x1e escaped", "plain"]
    path = tmp_path / "calibration.jsonl"
    path.write_bytes(b"".join(json.dumps({"text": t}, ensure_ascii=False).encode() + b"\r\n" for t in texts))
    assert all(c in path.read_text(encoding="utf-8") for c in RAW_BREAKS)
    assert [json.loads(line)["text"] for line in path.read_bytes().split(b"\n") if line.strip()] == texts
    assert _calibration_text(path) == "\n\n".join(texts)
    path.write_bytes(path.read_bytes() + b'{"text": \n')
    with pytest.raises(ValueError, match=r"calibration\.jsonl:4 is not JSON"):
        _calibration_text(path)


def test_calibration_text_is_read_up_to_a_bound(tmp_path, monkeypatch):
    """At most MAX_CALIBRATION_BYTES are read: the .jsonl line the bound cuts is left out (not "not JSON"),
    and a single line longer than the bound is refused by name."""
    from dgemma.cli import quant

    lines = [json.dumps({"text": f"sample {i} {RAW_BREAKS}"}, ensure_ascii=False) for i in range(50)]
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    keep = len("\n".join(lines[:20]).encode()) + 1
    monkeypatch.setattr(quant, "MAX_CALIBRATION_BYTES", keep + 7)  # inside line 21
    assert quant._calibration_text(path) == "\n\n".join(json.loads(line)["text"] for line in lines[:20])
    monkeypatch.setattr(quant, "MAX_CALIBRATION_BYTES", keep)  # just after line 20's newline
    assert quant._calibration_text(path).count("sample") == 20
    monkeypatch.setattr(quant, "MAX_CALIBRATION_BYTES", 10)
    with pytest.raises(ValueError, match=r"big\.jsonl:1 is longer than 10 bytes"):
        quant._calibration_text(path)
    (tmp_path / "big.txt").write_text("x" * 100)
    assert quant._calibration_text(tmp_path / "big.txt") == "x" * 10


@pytest.mark.parametrize("mode", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [(48, 64), (64, 64)])  # [out, in]; square: a transposed weight would run
def test_integer_and_fp8_matmul_kernels_equal_their_reference(mode, shape):
    """Error bounds derived from the arithmetic, per output element, against fp32 math on the dequantized
    weights: (1) the kernel against reference_matmul (same quantized activations) differs only by float
    rounding; (2) against the unquantized activations it is off by at most the activation quantization
    step times the weights' magnitudes, plus that rounding."""
    from dgemma.quant.kernels import quantize_rows, quantized_matmul, reference_matmul

    torch.manual_seed(0)
    k = shape[1]
    q = quantize(torch.randn(shape), mode)
    row_scales = torch.logspace(-3, 2, 15).reshape(3, 5, 1)  # a scale applied to the wrong row shows
    x = torch.randn(3, 5, k) * row_scales
    y = quantized_matmul(x, q).double().reshape(15, -1)
    x2 = x.reshape(15, k)
    codes, scale = quantize_rows(x2, mode)  # deterministic: the kernel's own activation codes
    x_hat, w, scale = codes.double() * scale.double(), dequantize(q).double(), scale.double()
    exact = x_hat @ w.T  # the kernel's computation in exact arithmetic (float64 is exact enough here)
    # Each fp32 operation rounds by at most u relative; a dot of K products rounds at most K - 1 times in
    # any summation order (blocking, FMA, threads), plus one rounding each for x_hat, w and the 2 scales
    u = 2.0**-24
    rounding = (k + 4) * u * (x_hat.abs() @ w.abs().T)
    if mode == "fp8":  # _scaled_mm returns bf16: one more rounding of the result, 2^-8 relative
        rounding = rounding + 2.0**-8 * exact.abs()
    assert ((y - exact).abs() <= rounding).all(), ((y - exact).abs() / rounding).max()
    # reference_matmul is the same exact value computed in fp32: its own rounding adds at most as much
    reference = reference_matmul(x, q).double().reshape(15, -1)
    assert ((y - reference).abs() <= rounding + (k + 4) * u * (x_hat.abs() @ w.abs().T)).all()
    # Activation quantization: int8 rounds x / scale to an integer (half a step, scale / 2); fp8 e4m3 keeps
    # 3 mantissa bits (2^-4 of |x| relative) down to its subnormals, spaced 2^-9 scale (half: 2^-10 scale).
    # 1e-4 relative covers the fp32 roundings of x / scale and codes * scale (a few u, u = 6e-8).
    step = (scale / 2).expand(-1, k) if mode == "int8" else torch.maximum(x2.abs().double() / 16, scale / 1024)
    truth = x2.double() @ w.T  # fp32 activations times the dequantized weights, computed exactly
    bound = (1 + 1e-4) * (step @ w.abs().T) + rounding
    ratio = (y - truth).abs() / bound
    assert ratio.max() <= 1, ratio.max()


@pytest.mark.parametrize("mode", ["int8", "fp8"])
def test_kernels_switch_on_and_off_in_a_model(mode):
    from dgemma.quant import use_kernels

    config = dgemma.preset("tiny")
    model = quantize_model(dgemma.build(config, seed=0), mode, group_size=16)
    ids = torch.randint(0, config.text_config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))

    def hidden():
        cache = model.new_cache(batch_size=1, max_length=16)
        return model.encode(ids, cache).hidden_states

    with torch.no_grad():
        weight_only = hidden()
        use_kernels(model)
        assert model.layers[0].self_attn.q_proj.kernel and model.layers[0].experts.kernel
        with_kernels = hidden()
        use_kernels(model, enable=False)
        torch.testing.assert_close(hidden(), weight_only, rtol=0, atol=0)
    assert not torch.equal(with_kernels, weight_only)  # activations are quantized too
    assert torch.isfinite(with_kernels).all()


def test_nvfp4_kernel_operands_are_what_torchao_hands_the_fp4_matmul():
    """The native NVFP4 kernel passes dgemma's codes and block scales to torch._scaled_mm unchanged
    except for the scales' swizzle; torchao (the library of this kernel) is the oracle of both: its
    to_blocked gives the same bytes, and its NVFP4Tensor reads dgemma's codes and scales as the same
    values (with the global scale at 1 both compute e2m1 * scale in fp32: bit-equal)."""
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor
    from torchao.prototype.mx_formats.utils import to_blocked as torchao_blocked

    from dgemma.quant.kernels import to_blocked

    torch.manual_seed(0)
    for rows, k in [(128, 64), (200, 48), (7, 16), (300, 2112)]:  # tiles full, ragged, smaller than one tile
        q = quantize(torch.randn(rows, k) * torch.logspace(-2, 1, rows).unsqueeze(1), "nvfp4")
        assert torch.equal(to_blocked(q.scales).view(torch.uint8), torchao_blocked(q.scales).view(torch.uint8))
        theirs = NVFP4Tensor(q.codes, q.scales, 16, torch.float32).dequantize(torch.float32)
        q.global_scale = torch.ones_like(q.global_scale)
        torch.testing.assert_close(theirs, dequantize(q), rtol=0, atol=0)


def test_nvfp4_w4a4_emulation_is_the_product_of_the_quantized_operands():
    """Without a Blackwell GPU the W4A4 path runs emulated; it must be the exact product of the NVFP4
    activations and weights (float64 check: fp32 accumulation over K adds at most K * u relative), and
    within NVFP4's activation error of the W4A16 product (a 16-block's step is at most its max / 6 times
    e4m3's rounding 1 + 2^-4: bounded by |x| summed per block times the weights)."""
    from dgemma.quant.formats import quantize_nvfp4
    from dgemma.quant.kernels import native_fp4, quantized_matmul

    assert not native_fp4("cpu")
    torch.manual_seed(0)
    q = quantize(torch.randn(48, 64), "nvfp4")
    x = torch.randn(3, 5, 64) * torch.logspace(-2, 1, 15).reshape(3, 5, 1)
    y = quantized_matmul(x, q).double().reshape(15, -1)
    x_hat, w = dequantize(quantize_nvfp4(x.reshape(15, 64))).double(), dequantize(q).double()
    exact = x_hat @ w.T
    assert ((y - exact).abs() <= 70 * 2.0**-24 * (x_hat.abs() @ w.abs().T)).all()
    block_max = x.reshape(15, 4, 16).abs().amax(-1, keepdim=True).expand(-1, -1, 16).reshape(15, 64).double()
    # half an e2m1 step is at most 1 (the step between 4 and 6) of scale max/6, and the block scale
    # itself rounds up by up to 2^-4 in e4m3, so |x - x_hat| <= block_max / 6 * (1 + 2^-4)
    bound = (block_max / 6 * (1 + 2.0**-4)) @ w.abs().T
    assert ((y - x.reshape(15, 64).double() @ w.T).abs() <= bound * 1.001 + 1e-6).all()


def test_nvfp4_kernel_switches_on_only_where_asked_or_native():
    from dgemma.quant import use_kernels

    model = quantize_model(dgemma.build(dgemma.preset("tiny"), seed=0), "nvfp4")
    use_kernels(model)  # CPU: no native FP4, so nvfp4 stays weight-only
    assert model.layers[0].self_attn.q_proj.kernel is None
    use_kernels(model, fp4=True)
    assert model.layers[0].self_attn.q_proj.kernel == "scaled_mm_fp4" and model.layers[0].experts.kernel
    ids = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        w4a4 = model.encode(ids, model.new_cache(batch_size=1, max_length=16)).hidden_states
        use_kernels(model, enable=False)
        w4a16 = model.encode(ids, model.new_cache(batch_size=1, max_length=16)).hidden_states
    assert torch.isfinite(w4a4).all() and not torch.equal(w4a4, w4a16)


@pytest.mark.skipif(
    not (torch.cuda.is_available() and __import__("dgemma.quant.kernels").quant.kernels.native_fp4("cuda")),
    reason="needs a GPU with native FP4 matmuls (compute capability >= 10)",
)
def test_native_nvfp4_matmul_equals_its_emulation_on_blackwell():
    from dgemma.quant.kernels import nvfp4_emulated, nvfp4_native

    torch.manual_seed(0)
    q = quantize(torch.randn(256, 512), "nvfp4")
    q = type(q)(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(q).items()})
    x = torch.randn(40, 512, device="cuda")
    emulated = nvfp4_emulated(x, q)
    # the kernel returns bf16 (2^-8 relative) of an fp32 accumulation
    torch.testing.assert_close(nvfp4_native(x, q), emulated, rtol=2**-7, atol=1e-3 * emulated.abs().max().item())
