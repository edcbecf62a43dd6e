"""Checkpoint loading and saving: layouts, dtypes, strict validation, atomic bit-exact round trips."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import fp32_tolerance, load_quiet
from safetensors.torch import load_file, save_file

import dgemma


def _copy(src: Path, dst: Path, edit=None) -> Path:
    """Copy a checkpoint; `edit(tensors)` may change the tensor dict before it is written back."""
    shutil.copytree(src, dst)
    if edit is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _states_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)


def test_loads_transformers_checkpoint_with_its_vision_tower(moe_ckpt, tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = dgemma.load(moe_ckpt[0])
    assert not [w for w in caught if "vision" in str(w.message)]
    assert model.dtype == torch.float32 and not model.training
    assert not any(t.is_meta for t in model.state_dict().values())
    theirs = load_file(str(moe_ckpt[0] / "model.safetensors"))
    vision = [k for k in theirs if k.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision."))]
    assert vision and all(torch.equal(model.state_dict()[k[len("model.encoder.") :]], theirs[k]) for k in vision)
    # a vision_config without the tower's tensors: text only, said once
    stripped = _copy(moe_ckpt[0], tmp_path / "text", lambda t: [t.pop(k) for k in vision])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text_only = dgemma.load(stripped)
    notices = [w for w in caught if "vision" in str(w.message)]
    assert len(notices) == 1 and "text-only" in str(notices[0].message) and text_only.vision_tower is None


def test_round_trip_is_bit_exact_and_transformers_reads_it(moe_ckpt, tmp_path):
    from transformers import DiffusionGemmaForBlockDiffusion

    model = load_quiet(moe_ckpt[0])
    dgemma.save(model, tmp_path / "a")
    again = dgemma.load(tmp_path / "a")
    assert _states_equal(model, again)
    dgemma.save(again, tmp_path / "b")
    assert (tmp_path / "a/model.safetensors").read_bytes() == (tmp_path / "b/model.safetensors").read_bytes()
    assert not list((tmp_path / "a").glob(".*tmp")), "no temporary files are left behind"
    # transformers loads what dgemma wrote: the same tensors, bit for bit (dgemma keeps no vision tower)...
    oracle = moe_ckpt[1]
    theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(tmp_path / "a").eval()
    loaded, ref_state = theirs.state_dict(), oracle.state_dict()
    text = [k for k in ref_state if "vision" not in k]
    assert len(text) > 100 and all(torch.equal(loaded[k], ref_state[k]) for k in text)
    # ...and the same logits to rounding: its tensors are memory-mapped, differently aligned buffers on
    # which MKL may take other kernel paths (it does on an AMD EPYC)
    ids, canvas = torch.randint(3, 512, (1, 9)), torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        ref = oracle(input_ids=ids, decoder_input_ids=canvas).logits
        out = theirs(input_ids=ids, decoder_input_ids=canvas).logits
    text_config = oracle.config.text_config
    tol = fp32_tolerance(ref.abs().max().item(), text_config.hidden_size, text_config.num_hidden_layers)
    torch.testing.assert_close(out, ref, rtol=0, atol=tol)


def test_sharded_save_and_load(moe_ckpt, tmp_path):
    model = load_quiet(moe_ckpt[0])
    dgemma.save(model, tmp_path, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (tmp_path / "model.safetensors").exists()
    assert _states_equal(model, dgemma.load(tmp_path))


@pytest.mark.parametrize("dtype", ["bf16", torch.float16, "float32"])
def test_load_in_requested_dtype(moe_ckpt, tmp_path, dtype):
    model = load_quiet(moe_ckpt[0], dtype=dtype)
    want = dgemma.checkpoints.weights.resolve_dtype(dtype)
    assert all(t.dtype == want for t in model.state_dict().values())
    dgemma.save(model, tmp_path)
    assert dgemma.load(tmp_path).dtype == want  # 'auto' keeps the stored dtype
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")


def test_both_sides_stored_in_full(moe_ckpt, tmp_path):
    """Official checkpoints may store the tied encoder copies and lm_head; they load and are checked."""

    def add_copies(t):
        for name in [n for n in t if n.startswith("model.decoder.") and "self_conditioning" not in n]:
            if not name.endswith("layer_scalar"):
                t[name.replace("model.decoder.", "model.encoder.language_model.")] = t[name].clone()
        t["lm_head.weight"] = t["model.decoder.embed_tokens.weight"].clone()

    full = _copy(moe_ckpt[0], tmp_path / "full", add_copies)
    assert _states_equal(load_quiet(full), load_quiet(moe_ckpt[0]))

    def corrupt(t):
        add_copies(t)
        t["model.encoder.language_model.layers.1.mlp.up_proj.weight"] += 1e-3

    bad = _copy(moe_ckpt[0], tmp_path / "bad", corrupt)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight is stored as a tied copy"):
        load_quiet(bad)


def test_encoder_side_only_layout(moe_ckpt, tmp_path):
    def move(t):
        t["model.encoder.language_model.norm.weight"] = t.pop("model.decoder.norm.weight")

    assert _states_equal(load_quiet(_copy(moe_ckpt[0], tmp_path / "x", move)), load_quiet(moe_ckpt[0]))


def test_missing_unexpected_and_misshapen_tensors_in_one_error(moe_ckpt, tmp_path):
    def damage(t):
        del t["model.decoder.layers.2.self_attn.q_norm.weight"]
        del t["model.encoder.language_model.layers.4.layer_scalar"]
        t["model.decoder.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
        t["model.decoder.extra.weight"] = torch.zeros(2)

    d = _copy(moe_ckpt[0], tmp_path / "damaged", damage)
    with pytest.raises(ValueError) as err:
        load_quiet(d)
    msg = str(err.value)
    assert "missing tensors (2)" in msg and "model.decoder.layers.2.self_attn.q_norm.weight" in msg
    assert "model.encoder.language_model.layers.4.layer_scalar" in msg
    assert "unexpected tensors (1): model.decoder.extra.weight" in msg
    assert "model.decoder.layers.0.mlp.up_proj.weight: checkpoint (3, 3), model (128, 64)" in msg


def test_moe_weights_into_dense_config_are_unexpected(moe_ckpt, tmp_path):
    d = _copy(moe_ckpt[0], tmp_path / "dense_cfg")
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(num_experts=None, top_k_experts=None, moe_intermediate_size=None)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unexpected tensors \(42\): .*\(\+30 more\)"):
        load_quiet(d)


def test_pickle_files_are_refused(tmp_path, moe_ckpt):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(moe_ckpt[0] / "config.json", d)
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pickle file.*arbitrary code"):
        dgemma.load(d)
    with pytest.raises(ValueError, match="pickle file"):
        dgemma.load(d / "pytorch_model.bin")


def test_missing_files_and_corrupt_data(tmp_path, moe_ckpt):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dgemma.load(tmp_path / "nope")
    no_cfg = _copy(moe_ckpt[0], tmp_path / "no_cfg")
    (no_cfg / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        dgemma.load(no_cfg)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        dgemma.load(empty)
    corrupt = _copy(moe_ckpt[0], tmp_path / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        dgemma.load(corrupt)
    bad_json = _copy(moe_ckpt[0], tmp_path / "bad_json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        dgemma.load(bad_json)
    wrong_type = _copy(moe_ckpt[0], tmp_path / "wrong_type")
    (wrong_type / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
    with pytest.raises(ValueError, match="model_type 'gemma3'"):
        dgemma.load(wrong_type)


def test_missing_shard_is_named(moe_ckpt, tmp_path):
    model = load_quiet(moe_ckpt[0])
    dgemma.save(model, tmp_path, max_shard_bytes=200_000)
    victim = sorted(tmp_path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        dgemma.load(tmp_path)


def test_interrupted_save_keeps_the_previous_file(moe_ckpt, tmp_path, monkeypatch):
    model = load_quiet(moe_ckpt[0])
    dgemma.save(model, tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dgemma.checkpoints.weights, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        dgemma.save(model, tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_generation_config_is_read_and_written(moe_ckpt, tmp_path):
    d = _copy(moe_ckpt[0], tmp_path / "gen")
    (d / "generation_config.json").write_text(
        json.dumps(
            {
                "max_denoising_steps": 32,
                "sampler_config": {"entropy_bound": 0.2, "_cls_name": "EntropyBoundSamplerConfig"},
                "t_min": None,
                "eos_token_id": [1, 106],
            }
        )
    )
    model = load_quiet(d)
    gen = model.generation_config
    assert (gen.max_denoising_steps, gen.entropy_bound, gen.t_min, gen.eos_token_id) == (32, 0.2, 0.4, [1, 106])
    dgemma.save(model, tmp_path / "out")
    assert dgemma.GenerationConfig.from_file(tmp_path / "out") == gen


def test_progress_line(moe_ckpt, capfd):
    load_quiet(moe_ckpt[0], progress=True)
    err = capfd.readouterr().err
    assert "loading" in err and "tensors" in err and err.endswith("\n")


def test_saved_files_have_the_usual_permissions(moe_ckpt, tmp_path):
    """Atomic saves go through a temporary file; the files end with the mode open() gives (0666 less the
    umask), not the temporary file's private 0600."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        dgemma.save(load_quiet(moe_ckpt[0]), tmp_path / "out")
    finally:
        os.umask(old)
    for f in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
