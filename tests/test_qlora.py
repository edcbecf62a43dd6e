"""LoRA over quantized frozen weights (QLoRA), experts included: gradients against the same LoRA on the
dequantized model, what the backward pass keeps, the trainer with model.quant, save / load / merge."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

import dgemma
from dgemma.model.model import Experts
from dgemma.quant import QuantExperts, QuantLinear, dequantize, quantize_model
from dgemma.train.config import TrainConfig
from dgemma.train.lora import apply_lora, load_adapter, save_adapter
from dgemma.train.objective import ObjectiveConfig, block_diffusion_loss

sys.path.insert(0, str(Path(__file__).parent))
from test_train import EXAMPLES, _batch, _config

ROOT = Path(__file__).resolve().parent.parent
ALL = ["attention", "mlp", "experts"]


def _dequantized(quantized: dgemma.DiffusionGemma, like: dgemma.DiffusionGemma) -> dgemma.DiffusionGemma:
    """`like` (the unquantized model) with every quantized weight replaced by its fp32 dequantization."""
    model = copy.deepcopy(like)
    for (_, plain), (_, q) in zip(model.named_modules(), quantized.named_modules(), strict=True):
        if isinstance(q, QuantLinear):
            plain.weight.data = dequantize(q.quantized())
        elif isinstance(q, QuantExperts):
            for name in ("gate_up_proj", "down_proj"):
                getattr(plain, name).data = dequantize(q.quantized_stack(name))
    return model


def _adapted(model, experts="per_expert", seed=1):
    torch.manual_seed(seed)
    peft_model = apply_lora(model, r=4, alpha=8, targets=ALL, experts=experts)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:  # B starts at zero (no gradient reaches A): give it values
            torch.nn.init.normal_(p, std=0.05)
    return peft_model


def _grads(model, preset):
    batch = _batch(model, EXAMPLES, seed=3)
    loss, _ = block_diffusion_loss(model, batch, ObjectiveConfig(self_conditioning_prob=1.0, logit_chunk_tokens=7))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    ("preset", "mode", "experts"),
    [
        ("tiny", "int4", "per_expert"),
        ("tiny", "nvfp4", "shared"),
        ("tiny", "fp8", "per_expert"),
        ("tiny-dense", "int8", None),
    ],
)
def test_gradients_over_a_quantized_base_equal_those_over_its_dequantized_weights(preset, mode, experts):
    """The same LoRA on the quantized model and on an fp32 model holding the dequantized weights computes
    the same function; only the matmul shapes differ (tiles of rows, one expert at a time), so BLAS may
    sum in another order: fp32 rounding, a few ulps per dot of at most 256 terms, amplified through
    ~10 layers of forward and backward. 1e-4 of each gradient's largest entry is far below what a wrong
    backward (a missing tile, a transposed weight, a lost adapter) changes: those are O(1) relative."""
    base = dgemma.build(dgemma.preset(preset), seed=0)
    quantized = quantize_model(copy.deepcopy(base), mode, group_size=16)
    dequantized = _dequantized(quantized, base)  # before peft wraps `quantized` in place
    loss_q, grads_q = _grads(_adapted(quantized, experts or "per_expert"), preset)
    loss_d, grads_d = _grads(_adapted(dequantized, experts or "per_expert"), preset)
    assert grads_q.keys() == grads_d.keys() and len(grads_q) > 0
    if preset == "tiny":  # the experts' factors are trained too, with the shapes their kind gives
        factors = [g for n, g in grads_q.items() if ".experts.lora_A." in n]
        assert factors and all(g.shape[0] == (4 if experts == "per_expert" else 1) for g in factors)
    torch.testing.assert_close(loss_q, loss_d, rtol=1e-5, atol=0)
    for name, g in grads_q.items():
        assert g.abs().max() > 0, name  # every adapter gets a gradient
        torch.testing.assert_close(g, grads_d[name], rtol=0, atol=1e-4 * grads_d[name].abs().max().item())


def test_backward_keeps_no_dequantized_weight():
    """What autograd saves for the backward pass of an unrecomputed encoder pass: activations and codes
    only. A plain F.linear would save every dequantized weight (the whole model in bf16 for the 26B)."""
    config = dgemma.preset("tiny")
    model = _adapted(quantize_model(dgemma.build(config, seed=0), "int4", group_size=16))
    weights = {
        tuple(q.shape)
        for m in model.modules()
        if isinstance(m, QuantLinear | QuantExperts)
        for q in ([m.quantized()] if isinstance(m, QuantLinear) else [m.quantized(n, 0) for n in m.shapes])
    }
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    ids = torch.randint(0, config.text_config.vocab_size, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cache = model.new_cache(batch_size=1, max_length=13, keep_all=True)
        model.encode(ids, cache).hidden_states.sum()
    float_saved = [s for s, dtype in saved if dtype.is_floating_point and dtype.itemsize >= 2]
    assert float_saved and not [s for s in float_saved if s in weights], weights


def test_saved_adapters_reload_and_merge_into_a_quantized_base(tmp_path):
    """An adapter trained on a quantized base reloads onto it (same logits); merging into it re-quantizes
    dequantize(W) + B A * scaling in the same format; merging into the bf16 base adds the delta there."""
    base = dgemma.build(dgemma.preset("tiny"), seed=0)
    for kind in ("per_expert", "shared"):
        peft_model = _adapted(quantize_model(copy.deepcopy(base), "int4", group_size=16), kind)

        def logits(m):
            ids = torch.randint(0, 100, (1, 12), generator=torch.Generator().manual_seed(0))
            cache = m.new_cache(batch_size=1, max_length=20)
            m.encode(ids, cache)
            return m.denoise(torch.arange(8)[None], cache)

        with torch.no_grad():
            expected = logits(peft_model)
        out = tmp_path / kind
        save_adapter(peft_model, out, peft_model.state_dict())
        reloaded = load_adapter(quantize_model(copy.deepcopy(base), "int4", group_size=16), out, merge=False)
        with torch.no_grad():
            torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=0)
        layer = peft_model.base_model.model.layers[0]
        delta = layer.experts.get_delta_weight("default", "down_proj", 3)
        base_q = layer.experts.get_base_layer()
        want = quantize_model(copy.deepcopy(base), "int4", group_size=16).layers[0].experts
        want.set_expert("down_proj", 3, base_q.expert("down_proj", 3, torch.float32) + delta)
        merged = load_adapter(quantize_model(copy.deepcopy(base), "int4", group_size=16), out, merge=True)
        assert isinstance(merged.layers[0].experts, QuantExperts)
        assert torch.equal(merged.layers[0].experts.down_proj[3], want.down_proj[3])
        q_delta = layer.self_attn.q_proj.get_delta_weight("default")
        plain = load_adapter(copy.deepcopy(base), out, merge=True)
        assert isinstance(plain.layers[0].experts, Experts)
        torch.testing.assert_close(
            plain.layers[0].self_attn.q_proj.weight, base.layers[0].self_attn.q_proj.weight + q_delta
        )
        torch.testing.assert_close(plain.layers[0].experts.down_proj[3], base.layers[0].experts.down_proj[3] + delta)


def test_trainer_with_a_quantized_base_learns_and_resumes_exactly(tmp_path):
    lora = {"r": 4, "alpha": 8, "targets": ALL}
    cfg = _config(tmp_path, model={"preset": "tiny", "quant": "nvfp4"}, lora=lora, train={"steps": 8, "save_every": 4})
    cfg.optim.lr = 1e-2
    from dgemma.train.trainer import train

    full = train(cfg, progress=False)
    assert sum(full.losses[-3:]) / 3 < sum(full.losses[:3]) / 3  # it learns
    cfg.train.out_dir = str(tmp_path / "resumed")
    part = train(cfg, progress=False, stop_after=4)
    rest = train(cfg, progress=False)
    assert part.losses + rest.losses == full.losses  # bit for bit
    saved = json.loads((full.final_dir / "adapter_config.json").read_text())
    assert "experts" in saved["target_modules"]


def test_config_refusals():
    data = {"model": {"preset": "tiny", "quant": "int4"}, "data": {"train": "x.jsonl"}, "train": {}}
    with pytest.raises(ValueError, match="needs a lora section"):
        TrainConfig.from_dict(data)
    with pytest.raises(ValueError, match=r"model\.quant must be one of"):
        TrainConfig.from_dict({**data, "model": {"preset": "tiny", "quant": "int3"}, "lora": {}})
    with pytest.raises(ValueError, match=r"lora\.experts must be"):
        TrainConfig.from_dict({**data, "lora": {"experts": "some"}})
    with pytest.raises(ValueError, match=r"lora\.dtype must be"):
        TrainConfig.from_dict({**data, "lora": {"dtype": "fp8"}})


def test_the_24gb_recipe_runs_a_few_steps_on_a_random_small_model(tmp_path):
    """recipes/sudoku-lora-26b-24gb.yaml as written (quantized base, LoRA on attention, MLP and experts),
    with only the model swapped for a random-weight `small` preset and a few steps."""
    import yaml

    from dgemma.train.trainer import train

    recipe = yaml.safe_load((ROOT / "recipes" / "sudoku-lora-26b-24gb.yaml").read_text())
    assert recipe["model"]["quant"] and "experts" in recipe["lora"]["targets"] and recipe["lora"]["r"] == 8
    recipe["model"] = {k: v for k, v in recipe["model"].items() if k != "path"} | {"preset": "small", "dtype": "fp32"}
    recipe["data"] = {**recipe["data"], "train": str(_toy(tmp_path)), "eval": None, "max_length": 64}
    recipe["train"] |= {"steps": 2, "batch_size": 1, "out_dir": str(tmp_path / "run"), "save_every": 2}
    result = train(TrainConfig.from_dict(recipe, base_dir=tmp_path), progress=False)
    assert result.steps == 2 and all(torch.isfinite(torch.tensor(result.losses)))


def _toy(tmp_path: Path) -> Path:
    from test_train import _toy_jsonl

    return _toy_jsonl(tmp_path / "toy.jsonl", n=4)


@pytest.mark.parametrize("experts", ["per_expert", "shared"])
def test_expert_adapters_compute_what_merging_them_gives(experts):
    """On an fp32 base, the adapted experts (dispatched expert by expert, delta B_e A_e x added) equal the
    reference Experts loop on the merged weights W_e + B_e A_e * scaling: fp32 rounding of two ways of
    summing the same products (1e-5 of the output's scale)."""
    base = dgemma.build(dgemma.preset("tiny"), seed=0)
    peft_model = _adapted(copy.deepcopy(base), experts)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))

    def logits(m):
        cache = m.new_cache(batch_size=2, max_length=20)
        m.encode(ids, cache)
        return m.denoise(torch.arange(16).view(2, 8), cache)

    with torch.no_grad():
        adapted = logits(peft_model)
        merged = peft_model.merge_and_unload()
        assert type(merged.layers[0].experts) is Experts
        reference = logits(merged)
        assert not torch.allclose(reference, logits(base), atol=1e-3)  # the adapters change the model
    torch.testing.assert_close(adapted, reference, rtol=0, atol=1e-5 * reference.abs().max().item())


def test_checkpointing_recomputes_the_encoder_too_with_the_same_gradients(monkeypatch):
    """With gradient_checkpointing, encoder layers are recomputed in the backward pass as well (through a
    pinned view of the keep_all cache: the recomputation writes the same keys to the same slots), so no
    pass keeps a layer's activations. The recomputation repeats the same ops on the same inputs, so the
    gradients are the same (compared to rounding, 1e-6 of their scale, not to the bit: BLAS may thread a
    recomputed matmul differently)."""
    from dgemma.model.model import DecoderLayer

    base = dgemma.build(dgemma.preset("tiny"), seed=0)
    calls = {"n": 0}
    forward = DecoderLayer.forward

    def counting(self, *args, **kwargs):
        calls["n"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecoderLayer, "forward", counting)
    runs = {}
    for recompute in (False, True):
        calls["n"] = 0
        model = _adapted(quantize_model(copy.deepcopy(base), "int4", group_size=16))
        model.get_base_model().gradient_checkpointing = recompute
        runs[recompute] = _grads(model, "tiny"), calls["n"]
    layers = base.text_config.num_hidden_layers
    assert runs[False][1] == 3 * layers  # encoder, pass 1, pass 2
    assert runs[True][1] == 5 * layers  # and the encoder and pass 2 again in the backward pass
    (loss, grads), (loss_ck, grads_ck) = runs[False][0], runs[True][0]
    torch.testing.assert_close(loss_ck, loss, rtol=0, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(grads_ck[name], g, rtol=0, atol=1e-6 * g.abs().max().item())


def test_cli_merges_a_qlora_adapter_into_the_quantized_base(tmp_path, capsys):
    """`dgemma merge --quant nvfp4` quantizes the base as it loads and merges into it: the written
    checkpoint holds exactly load(base, quant) with the adapter merged (re-quantized)."""
    from dgemma.cli import main
    from dgemma.train.trainer import train

    base_dir = tmp_path / "base"
    dgemma.save(dgemma.build(dgemma.preset("tiny"), seed=0), base_dir)
    lora = {"r": 4, "alpha": 8, "targets": ALL}
    data = _config(tmp_path, lora=lora, train={"steps": 2, "save_every": 2}).to_dict()
    data["model"] = {"path": str(base_dir), "quant": "nvfp4"}
    cfg = TrainConfig.from_dict(data, base_dir=tmp_path)
    adapter = train(cfg, progress=False).final_dir
    out = tmp_path / "merged"
    assert main(["merge", "-m", str(base_dir), "--adapter", str(adapter), "--out", str(out), "--quant", "nvfp4"]) == 0
    written = dgemma.load(out)
    expected = load_adapter(dgemma.load(base_dir, quant="nvfp4"), adapter, merge=True)
    assert isinstance(written.layers[0].experts, QuantExperts)
    for (name, a), (_, b) in zip(written.state_dict().items(), expected.state_dict().items(), strict=True):
        assert torch.equal(
            a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8) if b.dtype.itemsize == 1 else b
        ), name
    untouched = dgemma.load(base_dir, quant="nvfp4")
    assert not torch.equal(written.layers[0].experts.down_proj, untouched.layers[0].experts.down_proj)
