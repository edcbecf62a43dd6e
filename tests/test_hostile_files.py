"""Files that fight back: autoregressive Gemma checkpoints and GGUF files written by their format's own
library (safetensors, gguf), then damaged. `dgemma adapt` refuses each in one line naming the file and the
field or tensor, before it allocates anything of the sizes the file claims; and OUT never overwrites the
source, for adapt as for quantize."""

from __future__ import annotations

import json
import re
import time

import gguf
import numpy as np
import pytest
import torch
from helpers import make_tokenizer
from safetensors.torch import load_file, save_file

from dgemma.checkpoints.from_ar import gemma3_text_config
from dgemma.checkpoints.gguf_file import _GLOBAL, _LAYER
from dgemma.cli import main
from dgemma.model.config import DiffusionGemmaConfig
from dgemma.model.model import build

CONFIG = dict(model_type="gemma3_text", vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
              max_position_embeddings=128, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
METADATA = {"context_length": 128, "embedding_length": 32, "block_count": 2, "feed_forward_length": 64,
            "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 16,
            "attention.sliding_window": 8}  # fmt: skip
PIECES = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", *"abcdefghijklmnopqrstuvwxyz"]


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    """A random tiny Gemma 3 text model's tensors under dgemma's names."""
    text = gemma3_text_config(CONFIG)
    config = DiffusionGemmaConfig(text_config=text, canvas_length=8, boi_token_id=None, eoi_token_id=None,
                                  image_token_id=None)  # fmt: skip
    state = build(config, seed=0).state_dict()
    return {n: t for n, t in state.items() if not n.startswith("self_conditioning.") and not n.endswith("layer_scalar")}


@pytest.fixture(scope="module")
def tokenizer():
    """A 512-token tokenizer, as the checkpoints carry it."""
    return make_tokenizer(512)


def _hf(path, weights, tokenizer, config=None, tensors=None):
    """A Gemma 3 Hugging Face checkpoint directory: config.json, model.safetensors (by safetensors), tokenizer."""
    path.mkdir(parents=True)
    save_file(tensors or {f"model.{n}": t for n, t in weights.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    tokenizer.save(path)
    return path


def _gguf_name(ours: str) -> str:
    """A tensor's GGUF name, from dgemma's."""
    if ours.startswith("layers."):
        _, i, rest = ours.split(".", 2)
        return f"blk.{i}." + {v: k for k, v in _LAYER.items()}[rest]
    return {v: k for k, v in _GLOBAL.items() if k != "self_cond_norm.weight"}[ours]


def _gguf(path, weights, metadata=None, tensors=None, pieces=None):
    """A Gemma 3 GGUF written by gguf's GGUFWriter: llama.cpp's metadata (`metadata` replacing some, an array
    or a uint64 each), a SentencePiece vocabulary (`pieces`), the tensors (`tensors` replacing or, None,
    dropping some)."""
    writer = gguf.GGUFWriter(str(path), arch="gemma3")
    for key, value in (METADATA | (metadata or {})).items():
        add = writer.add_array if isinstance(value, list) else writer.add_string if isinstance(value, str) else None
        (add or (writer.add_uint64 if value > 2**31 else writer.add_uint32))(f"gemma3.{key}", value)
    writer.add_float32("gemma3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("gemma3.rope.freq_base", 1e6)
    pieces = pieces or PIECES + [f"x{i}" for i in range(512 - len(PIECES))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_types([3, 3, 3, 2] + [1] * (len(pieces) - 4))
    writer.add_token_scores([0.0] * len(pieces))
    for setter, i in ((writer.add_pad_token_id, 0), (writer.add_eos_token_id, 1), (writer.add_bos_token_id, 2)):
        setter(i)
    writer.add_unk_token_id(3)
    data = {_gguf_name(n): t.float().numpy() for n, t in weights.items()} | (tensors or {})
    for name, value in data.items():
        if value is not None:
            writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _refused(capsys, source, out, message: str) -> str:
    """`dgemma adapt SOURCE OUT` fails with one line naming the source and matching `message`, writing nothing."""
    assert main(["adapt", str(source), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("dgemma adapt: error: "), err
    assert str(source) in err or source.name in err, err
    assert re.search(message, err), err
    assert not out.exists()
    return err


def test_the_undamaged_files_adapt(tmp_path, weights, tokenizer, capsys):
    """The control: the files the damages below start from adapt."""
    assert main(["adapt", str(_hf(tmp_path / "hf", weights, tokenizer)), str(tmp_path / "a"), "--dtype", "fp32"]) == 0
    assert main(["adapt", str(_gguf(tmp_path / "m.gguf", weights)), str(tmp_path / "b"), "--dtype", "fp32"]) == 0
    assert (tmp_path / "a" / "model.safetensors").is_file() and (tmp_path / "b" / "model.safetensors").is_file()


def _config(**change):
    """config.json's object with `change` (None: the key removed)."""
    return {k: v for k, v in (CONFIG | change).items() if v is not None}


def _damaged_tensor(name: str, value):
    """The tensors as written, tensor `name` replaced by `value` of it."""
    return lambda w: {f"model.{n}": (value(t) if n == name else t) for n, t in w.items()}


# damage -> (config.json's object, or text; the tensors written, from the good ones; bytes replacing the
# safetensors file; the error)
HF_DAMAGES = {
    "config without hidden_size": (_config(hidden_size=None), None, None, r"config\.json: hidden_size is missing"),
    "config a list": ("[1, 2]", None, None, r"config\.json must hold a JSON object \(got list\)"),
    "config not JSON": ('{"model_type": ', None, None, r"config\.json is not valid JSON"),
    "text_config a list": ({"model_type": "gemma3", "text_config": [1]}, None, None, "text_config must be an object"),
    "hidden_size 10**9": (
        _config(hidden_size=10**9),
        None,
        None,
        "hidden_size is 1000000000, but the file's tensors hold 32",
    ),
    "num_hidden_layers 10**6": (_config(num_hidden_layers=10**6), None, None, "num_hidden_layers is 1000000, but"),
    "vocab_size 10**12": (_config(vocab_size=10**12), None, None, "vocab_size must be a positive integer"),
    "intermediate_size 10**9": (_config(intermediate_size=10**9), None, None, r"wrong shapes .*mlp\.down_proj"),
    "head count a string": (_config(num_attention_heads="2"), None, None, "num_attention_heads must be an integer"),
    "heads of 0": (_config(num_key_value_heads=0), None, None, "num_key_value_heads must be a positive integer"),
    "rope_theta NaN": (_config(rope_theta=float("nan")), None, None, r"rope_theta must be a finite number"),
    "truncated safetensors": (
        None,
        None,
        lambda b: b[: len(b) // 2],
        "model.safetensors is not a readable safetensors",
    ),
    "random-bytes safetensors": (None, None, lambda b: bytes(range(256)) * 8, "is not a readable safetensors file"),
    "a tensor of the wrong shape": (
        None,
        _damaged_tensor("layers.0.self_attn.q_proj.weight", lambda t: t[:3]),
        None,
        r"wrong shapes \(1\): layers\.0\.self_attn\.q_proj\.weight \(3, 32\) \(config: \(32, 32\)\)",
    ),
    "int32 embedding": (
        None,
        _damaged_tensor("embed_tokens.weight", lambda t: t.int()),
        None,
        r"model\.safetensors: model\.embed_tokens\.weight holds int32 values, not floating-point",
    ),
    "a NaN weight": (
        None,
        _damaged_tensor("layers.1.mlp.up_proj.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))),
        None,
        r"model\.layers\.1\.mlp\.up_proj\.weight holds non-finite values",
    ),
    "an inf norm": (
        None,
        _damaged_tensor("norm.weight", lambda t: torch.full_like(t, float("inf"))),
        None,
        r"model\.norm\.weight holds non-finite values",
    ),
    "a missing tensor": (
        None,
        lambda w: {f"model.{n}": t for n, t in w.items() if n != "layers.1.self_attn.k_norm.weight"},
        None,
        r"missing tensors \(1\): layers\.1\.self_attn\.k_norm\.weight",
    ),
}


@pytest.mark.parametrize("case", sorted(HF_DAMAGES))
def test_damaged_hugging_face_checkpoints_are_refused_in_one_line(tmp_path, weights, tokenizer, capsys, case):
    config, tensors, file_bytes, message = HF_DAMAGES[case]
    source = _hf(tmp_path / "src", weights, tokenizer, tensors=tensors(weights) if tensors else None)
    if config is not None:
        (source / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if file_bytes is not None:
        path = source / "model.safetensors"
        path.write_bytes(file_bytes(path.read_bytes()))
    _refused(capsys, source, tmp_path / "out", message)


def _nan_rows(t: np.ndarray) -> np.ndarray:
    """`t` with a row of NaN."""
    t = t.copy()
    t[1] = np.nan
    return t


# damage -> (metadata replaced, tensors replaced (None: dropped), the error)
GGUF_DAMAGES = {
    "block_count an array": ({"block_count": [1, 2]}, {}, r"gemma3\.block_count must be a positive integer .*\[1, 2\]"),
    "block_count 10**9": (
        {"block_count": 10**9},
        {},
        r"gemma3\.block_count is 1000000000, but the file's tensors hold 2",
    ),
    "block_count 10**12": ({"block_count": 10**12}, {}, r"gemma3\.block_count must be a positive integer"),
    "embedding_length 10**9": ({"embedding_length": 10**9}, {}, r"gemma3\.embedding_length is 1000000000, but"),
    "feed_forward_length 10**9": ({"feed_forward_length": 10**9}, {}, r"wrong shapes \(6\)"),
    "head_count a string": ({"attention.head_count": "2"}, {}, r"gemma3\.attention\.head_count must be a positive"),
    "no token_embd.weight": ({}, {"token_embd.weight": None}, "the file has no token_embd.weight tensor"),
    "a tensor of the wrong shape": (
        {},
        {"blk.0.attn_q.weight": np.zeros((3, 32), np.float32)},
        r"wrong shapes \(1\): layers\.0\.self_attn\.q_proj\.weight \(3, 32\)",
    ),
    "int32 embedding": (
        {},
        {"token_embd.weight": np.zeros((512, 32), np.int32)},
        "token_embd.weight holds int32 values",
    ),
    "a NaN weight": (
        {},
        {"blk.1.ffn_down.weight": _nan_rows(np.ones((32, 64), np.float32))},
        "blk.1.ffn_down.weight holds non-finite",
    ),
}


@pytest.mark.parametrize("case", sorted(GGUF_DAMAGES))
def test_damaged_gguf_files_are_refused_in_one_line(tmp_path, weights, capsys, case):
    metadata, tensors, message = GGUF_DAMAGES[case]
    _refused(capsys, _gguf(tmp_path / "m.gguf", weights, metadata, tensors), tmp_path / "out", message)


@pytest.mark.parametrize("cut", [0.5, 0.99])
def test_a_truncated_gguf_is_refused_in_one_line(tmp_path, weights, capsys, cut):
    path = _gguf(tmp_path / "m.gguf", weights)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * cut)])
    _refused(capsys, path, tmp_path / "out", "is not a readable GGUF file")


def test_a_one_megabyte_vocabulary_piece_is_refused_at_once(tmp_path, weights, capsys):
    """Rebuilding merges costs the square of a piece's length: a 1 MB piece took over a minute."""
    pieces = PIECES + [f"x{i}" for i in range(512 - len(PIECES) - 1)] + ["ab" * 500_000]
    path = _gguf(tmp_path / "m.gguf", weights, pieces=pieces)
    start = time.monotonic()
    _refused(capsys, path, tmp_path / "out", r"token 511 \('abab.*is 1000000 characters long; .* at most 256")
    assert time.monotonic() - start < 30


def test_sentencepiece_pieces_are_bounded():
    from dgemma.checkpoints.sentencepiece import MAX_PIECE_CHARS, gemma_tokenizer_json

    pieces = ["<pad>", "<eos>", "<bos>", "<unk>", "a" * MAX_PIECE_CHARS]
    assert json.loads(gemma_tokenizer_json(pieces, [3, 3, 3, 2, 1], unk_id=3, bos_id=2))["model"]["vocab"]
    with pytest.raises(ValueError, match=f"token 4 .* is {MAX_PIECE_CHARS + 1} characters long"):
        gemma_tokenizer_json([*pieces[:4], "a" * (MAX_PIECE_CHARS + 1)], [3, 3, 3, 2, 1], unk_id=3, bos_id=2)


# -- OUT never overwrites the source -----------------------------------------------------------------------


def test_adapt_and_quantize_never_write_over_their_source(tmp_path, weights, tokenizer, capsys):
    """OUT == SOURCE (--force or not, by a link or `..`), OUT inside a SOURCE directory, a SOURCE inside OUT:
    each refused before anything is read or written; the source's files stay as they were."""
    source = _hf(tmp_path / "src", weights, tokenizer)
    gguf_dir = tmp_path / "g"
    gguf_dir.mkdir()
    single = _gguf(gguf_dir / "m.gguf", weights)
    (tmp_path / "link").symlink_to(source)
    before = {p.name: p.read_bytes() for p in [*source.iterdir(), single]}
    cases = [
        (source, source, "is SOURCE"),
        (source, tmp_path / "link", "is SOURCE"),
        (source, source / ".." / "src", "is SOURCE"),
        (source, source / "sub", "lies inside SOURCE"),
        (single, single, "is SOURCE"),
        (single, gguf_dir, "holds SOURCE"),
        (source, tmp_path, "holds SOURCE"),
    ]
    for src, out, message in cases:
        assert main(["adapt", str(src), str(out), "--force"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and message in err and "never overwritten" in err, err
    for src, out, message in [(source, source, "is DIR"), (source, source / "q", "lies inside DIR")]:
        assert main(["quantize", str(src), str(out), "--quant", "int8", "--force"]) == 2
        assert message in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in [*source.iterdir(), single]} == before
    assert not (source / "sub").exists() and not (source / "q").exists()


def test_a_written_checkpoint_is_what_adapt_read(tmp_path, weights, tokenizer):
    """The values written are the file's (Gemma 3 norms as 1 + w): the checks read what they pass on."""
    source = _hf(tmp_path / "src", weights, tokenizer)
    assert main(["adapt", str(source), str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    written = load_file(tmp_path / "out" / "model.safetensors")
    q = next(n for n in written if n.endswith("decoder.layers.0.self_attn.q_proj.weight"))
    norm = next(n for n in written if n.endswith("decoder.norm.weight"))
    assert torch.equal(written[q], weights["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(written[norm], weights["norm.weight"] + 1.0)
