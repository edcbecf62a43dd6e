"""Configuration: reading checkpoints' JSON, presets, derived per-layer values, validation, counts."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from dgemma import build, preset
from dgemma.model.config import FULL, SLIDING, DiffusionGemmaConfig, GenerationConfig, TextConfig
from dgemma.model.sizes import count_parameters


def _counted_on_modules(model) -> dict[str, int]:
    """Total and per-token active parameters read off the built modules (on meta too), to check
    config.count_parameters' arithmetic against what is actually built."""
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("vision_tower.", "embed_vision.")))
    t, inactive = model.text_config, 0
    if t.has_experts:
        for layer in model.layers:
            per_expert = (layer.experts.gate_up_proj.numel() + layer.experts.down_proj.numel()) // t.num_experts
            inactive += (t.num_experts - t.top_k_experts) * per_expert
    return {"total": total, "active": total - inactive - vision, "vision": vision}


def test_26b_a4b_on_meta_reports_published_counts():
    config = preset("26b-a4b")
    model = build(config, device="meta")
    assert all(p.is_meta for p in model.parameters())  # nothing allocated
    counts = _counted_on_modules(model)
    assert counts == count_parameters(config)
    assert 25.1e9 < counts["total"] < 25.3e9  # "25.2B total"
    assert 3.75e9 < counts["active"] < 3.9e9  # "3.8B active"


def test_26b_a4b_layer_layout():
    t = preset("26b-a4b").text_config
    assert t.layer_types == ([SLIDING] * 5 + [FULL]) * 5
    s, g = t.layer(0), t.layer(5)
    assert (s.head_dim, s.num_key_value_heads, s.sliding_window, s.rope_theta) == (256, 8, 1024, 1e4)
    assert (g.head_dim, g.num_key_value_heads, g.sliding_window, g.rope_theta) == (512, 2, None, 1e6)
    assert g.rope_type == "proportional" and g.partial_rotary_factor == 0.25 and not g.has_v_proj


@pytest.mark.parametrize("name", ["tiny", "tiny-dense", "small"])
def test_small_presets_build_and_run(name):
    config = preset(name)
    model = build(config)
    counts = _counted_on_modules(model)
    assert counts == count_parameters(config)
    if name == "small":
        assert config.text_config.vocab_size == 32_768 and 60e6 < counts["total"] < 80e6
    cache = model.new_cache(1, 32)
    model.encode(torch.tensor([[1, 2, 3]]), cache)
    logits = model.denoise(torch.zeros(1, config.canvas_length, dtype=torch.long), cache)
    assert logits.shape == (1, config.canvas_length, config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_reads_transformers_config_json(moe_ckpt):
    config = DiffusionGemmaConfig.from_file(moe_ckpt[0])
    ref = moe_ckpt[1].config.text_config
    t = config.text_config
    assert (t.hidden_size, t.num_hidden_layers, t.sliding_window, t.num_experts) == (
        ref.hidden_size,
        ref.num_hidden_layers,
        ref.sliding_window,
        ref.num_experts,
    )
    assert t.layer_types == list(ref.layer_types)
    for i in range(t.num_hidden_layers):
        assert t.layer(i).head_dim == ref.per_layer_config[i].head_dim
        assert t.layer(i).num_key_value_heads == ref.per_layer_config[i].num_key_value_heads
    assert config.canvas_length == 8 and config.vision_config is not None


@pytest.mark.parametrize("name", ["26b-a4b", "tiny"])
def test_written_config_reads_back_in_transformers(name, tmp_path):
    """config.json carries the global layers' sizes in the release's form, the one vLLM reads
    (`global_head_dim`, `num_global_key_value_heads`; vLLM knows no `per_layer_config`), and transformers
    5.23 builds the same per-layer sizes from it, at two geometries."""
    from transformers import AutoConfig

    ours = preset(name)
    written = ours.to_dict()
    text = written["text_config"]
    assert "per_layer_config" not in text and text["attention_k_eq_v"] is True
    assert (text["global_head_dim"], text["num_global_key_value_heads"]) == (
        ours.text_config.global_head_dim,
        ours.text_config.num_global_key_value_heads,
    )
    (tmp_path / "config.json").write_text(json.dumps(written))
    theirs = AutoConfig.from_pretrained(tmp_path).text_config
    for i, layer in enumerate(ours.text_config.layers):
        assert (theirs.per_layer_config[i].head_dim, theirs.per_layer_config[i].num_key_value_heads) == (
            layer.head_dim,
            layer.num_key_value_heads,
        )
    assert DiffusionGemmaConfig.from_dict(written) == ours


def test_global_head_dim_form_and_defaults():
    base = {
        "model_type": "diffusion_gemma",
        "text_config": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "vocab_size": 300,
        },
    }
    c = DiffusionGemmaConfig.from_dict(base)
    assert c.text_config.global_head_dim == 512 and c.text_config.layer(5).num_key_value_heads == 2
    base["text_config"].update(global_head_dim=32, num_global_key_value_heads=1)
    c = DiffusionGemmaConfig.from_dict(base)
    assert (c.text_config.layer(5).head_dim, c.text_config.layer(5).num_key_value_heads) == (32, 1)
    base["text_config"]["attention_k_eq_v"] = False
    assert DiffusionGemmaConfig.from_dict(base).text_config.layer(5).num_key_value_heads == 2


def test_last_layer_forced_global_like_the_reference():
    with pytest.warns(UserWarning, match="last layer"):
        t = TextConfig(num_hidden_layers=4, layer_types=[SLIDING] * 4)
    assert t.layer_types[-1] == FULL


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"layer_types": ["sliding_attention", "chunked", "full_attention"], "num_hidden_layers": 3}, "layer_types"),
        ({"num_experts": 4, "top_k_experts": None}, "dense-only"),
        ({"top_k_experts": 9, "num_experts": 4}, "exceeds num_experts"),
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"head_dim": 15}, "even"),
        ({"hidden_size": 0}, "positive integer"),
        ({"eos_token_id": 10**9}, "outside the vocabulary"),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "yarn", "rope_theta": 1.0},
                    "full_attention": {"rope_theta": 1.0},
                }
            },
            "rope_type",
        ),
    ],
)
def test_validation_errors_name_the_field(change, message):
    d = preset("tiny").text_config.to_dict()
    d.update(change)
    with pytest.raises(ValueError, match=message):
        TextConfig.from_dict(d)


def test_rejects_other_model_types_and_bidirectional_encoder(tmp_path):
    with pytest.raises(ValueError, match="model_type 'gemma4'"):
        DiffusionGemmaConfig.from_dict({"model_type": "gemma4", "text_config": {}})
    d = preset("tiny").to_dict()
    d["text_config"]["use_bidirectional_attention"] = "all"
    with pytest.raises(ValueError, match="encoder is causal"):
        DiffusionGemmaConfig.from_dict(d)
    d = preset("tiny").to_dict()
    d["text_config"]["per_layer_config"] = {"0": {"head_dim": 8}}
    with pytest.raises(ValueError, match="full-attention layers are"):
        DiffusionGemmaConfig.from_dict(d)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "diffusion_gemma"}))
    with pytest.raises(ValueError, match="no text_config"):
        DiffusionGemmaConfig.from_file(tmp_path)


def test_generation_config_defaults_and_validation(tmp_path):
    assert GenerationConfig.from_file(tmp_path) == GenerationConfig()  # absent file: reference defaults
    g = GenerationConfig()
    assert (g.max_denoising_steps, g.entropy_bound, g.t_min, g.t_max) == (48, 0.1, 0.4, 0.8)
    assert (g.stability_threshold, g.confidence_threshold, g.max_new_tokens) == (1, 0.005, 256)
    with pytest.raises(ValueError, match="t_min < t_max"):
        GenerationConfig(t_min=0.9, t_max=0.8)
    with pytest.raises(ValueError, match="max_denoising_steps"):
        GenerationConfig(max_denoising_steps=0)
    assert GenerationConfig.from_dict(GenerationConfig(entropy_bound=0.3).to_dict()).entropy_bound == 0.3


def _write(tmp_path, name, d):
    (tmp_path / name).write_text(json.dumps(d))
    return tmp_path


def test_official_format_loads_without_notices(moe_ckpt, tmp_path):
    # every key transformers writes (architectures, vision_config, dtype, attention_dropout, ...) is known
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DiffusionGemmaConfig.from_file(moe_ckpt[0])
        GenerationConfig.from_file(moe_ckpt[0])
        GenerationConfig.from_dict({"temperature": 1.0, "min_new_tokens": 3, "do_sample": True})  # AR keys: unused


@pytest.mark.parametrize(
    "change, message",
    [
        ({"entropy_bound": "x"}, "entropy_bound must be a number (got 'x')"),
        ({"max_denoising_steps": True}, "max_denoising_steps must be an integer (got True)"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer (got 2.5)"),
        ({"eos_token_id": [1, "2"]}, "eos_token_id must be an integer or a list of integers or null"),
        ({"sampler_config": {"entropy_bound": "x"}}, "sampler_config: entropy_bound must be a number"),
        ({"sampler_config": 0.1}, "sampler_config must be an object"),
        ({"max_denoising_step": 8}, "unknown key 'max_denoising_step' .*; did you mean 'max_denoising_steps'"),
        ({"sampler_config": {"entropy_bond": 0.2}}, "sampler_config; did you mean 'entropy_bound'"),
    ],
)
def test_generation_config_json_is_type_checked(tmp_path, change, message):
    (tmp_path / "generation_config.json").write_text(json.dumps(change))
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "generation_config.json"))) as e:
        GenerationConfig.from_file(tmp_path)
    assert e.match(message if "did you mean" in message else re.escape(message))


def _without(d: dict, key: str) -> dict:
    d.pop(key)
    return d


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["text_config"].update(hidden_size="64"), "text_config: hidden_size must be an integer (got '64')"),
        (lambda d: d["text_config"].update(rms_norm_eps=None), "rms_norm_eps must be a number (got None)"),
        (lambda d: d["text_config"].update(layer_types="full"), "layer_types must be a list of strings or null"),
        (lambda d: d["text_config"].update(rope_parameters={"full_attention": 1}), "rope_parameters must be an obj"),
        (
            lambda d: d["text_config"]["rope_parameters"]["full_attention"].update(rope_theta="1e6"),
            "text_config rope_parameters['full_attention']: rope_theta must be a number (got '1e6')",
        ),
        (
            lambda d: d["text_config"].update(per_layer_config={"5": {"head_dim": "32"}}),
            "per_layer_config: head_dim must",
        ),
        (lambda d: d["text_config"].update(global_head_dim="32"), "global_head_dim must be an integer"),
        (lambda d: d.update(canvas_length="8"), "config.json: canvas_length must be an integer (got '8')"),
        (lambda d: d.update(boi_token_id=1.5), "boi_token_id must be an integer or null (got 1.5)"),
        (
            lambda d: _without(d["text_config"], "hidden_size").update(hiden_size=64),
            "unknown key 'hiden_size' in .*config.json text_config; did you mean 'hidden_size'\\?",
        ),
        (
            lambda d: _without(d, "canvas_length").update(canvas_lenght=8),
            "unknown key 'canvas_lenght' in .*config.json; did you mean 'canvas_length'",
        ),
    ],
)
def test_config_json_is_type_checked_and_misspellings_named(tmp_path, edit, message):
    d = preset("tiny").to_dict()
    edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match=message if "did you mean" in message else re.escape(message)):
        DiffusionGemmaConfig.from_file(tmp_path)


def test_other_unknown_keys_are_named_in_a_notice(tmp_path):
    d = preset("tiny").to_dict()
    d["text_config"]["hidden_size_for_lora"] = 3  # not a misspelling of a missing key
    d["text_config"]["hiden_size"] = 64  # close to hidden_size, which is given: a notice, not an error
    d["rope_theta"] = 10_000.0
    (tmp_path / "config.json").write_text(json.dumps(d))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        DiffusionGemmaConfig.from_file(tmp_path)
    assert sorted(str(w.message).split(": ", 1)[1] for w in record) == [
        "dgemma does not read 'hidden_size_for_lora', 'hiden_size'; ignored",  # text_config
        "dgemma does not read 'rope_theta'; ignored",  # the top level
    ]
    assert sum(" text_config: " in str(w.message) for w in record) == 1


def test_config_files_must_hold_a_utf8_json_object(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        DiffusionGemmaConfig.from_file(tmp_path)
    (tmp_path / "generation_config.json").write_bytes(b'{"t_min": "\xff"}')
    with pytest.raises(ValueError, match="not UTF-8"):
        GenerationConfig.from_file(tmp_path)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        preset("huge")
