"""Training: the objective's invariants, data handling, LoRA, exact resume, errors, and two processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import fp32_logit_tolerance, load_quiet, make_tokenizer

import dgemma
from dgemma.train.config import TrainConfig
from dgemma.train.data import DataError, Example, batch_indices, load_jsonl
from dgemma.train.lora import apply_lora, load_adapter
from dgemma.train.objective import ObjectiveConfig, assemble, block_diffusion_loss, draw_sample, encoder_loss
from dgemma.train.trainer import TrainingDiverged, train

ROOT = Path(__file__).resolve().parent.parent


def _toy_jsonl(path: Path, n: int = 48, seed: int = 0) -> Path:
    """Sort four digits, three times over: learnable, and long enough for two canvases of 8."""
    g = torch.Generator().manual_seed(seed)
    with path.open("w") as f:
        for _ in range(n):
            digits = torch.randint(10, 20, (4,), generator=g).tolist()
            f.write(json.dumps({"prompt_ids": [2, *digits, 3], "completion_ids": sorted(digits) * 3}) + "\n")
    return path


def _config(tmp_path: Path, **sections) -> TrainConfig:
    base = {
        "model": {"preset": "tiny"},
        "data": {"train": str(_toy_jsonl(tmp_path / "toy.jsonl")), "max_length": 64},
        "train": {"steps": 6, "batch_size": 4, "out_dir": str(tmp_path / "run"), "save_every": 3},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values} if values is not None else None
    return TrainConfig.from_dict({k: v for k, v in base.items() if v is not None}, base_dir=tmp_path)


def _batch(model, examples, cfg=None, seed=0):
    cfg = cfg or ObjectiveConfig()
    samples = [
        draw_sample(e, i, seed, model.config.canvas_length, model.text_config.vocab_size, cfg)
        for i, e in enumerate(examples)
    ]
    return assemble(samples, model.config.canvas_length, eos_id=1, pad_id=0)


EXAMPLES = [
    Example([2, 5, 6], list(range(10, 30))),
    Example([2, 7], list(range(40, 45))),
    Example([2, 8, 9, 10, 11], list(range(50, 70)), truncated=True),
]


# -- the objective ----------------------------------------------------------------------------------


def test_batch_layout_and_supervision():
    model = dgemma.build(dgemma.preset("tiny"))
    batch = _batch(model, EXAMPLES)
    c, start = 8, batch.canvas_start
    for row, (s, ex) in enumerate(
        zip([draw_sample(e, i, 0, 8, 512, ObjectiveConfig()) for i, e in enumerate(EXAMPLES)], EXAMPLES, strict=True)
    ):
        filled = ex.response + [1] * (-len(ex.response) % c)  # the end-of-text fill
        assert batch.clean[row].tolist() == filled[s.canvas * c : (s.canvas + 1) * c]
        prefix = ex.prompt + filled[: s.canvas * c]
        assert batch.ids[row, start - len(prefix) : start].tolist() == prefix
        flips = batch.noisy[row] != batch.clean[row]
        assert (flips <= s.flip).all()  # only flipped positions differ (a flip may land on the same token)
    # the fill after a truncated response is neither supervised nor an encoder target
    assert not batch.ar_targets[2, batch.valid[2].nonzero().max()]
    assert batch.supervised.all()  # every selected canvas here holds real tokens or a real end


def test_encoder_targets_response_scores_only_unpinned_response_tokens():
    """The AR twin of a task model is scored on what the diffusion model predicts: the response tokens
    that are not pinned, never the prompt."""
    pins = (True, False, False, True, False, False, False, False)
    ex = Example([2, 5, 6, 7], list(range(10, 18)), pinned=pins)
    cfg = ObjectiveConfig()
    s = draw_sample(ex, 0, 0, 8, 512, cfg)
    full = assemble([s], 8, eos_id=1, pad_id=0)
    resp = assemble([s], 8, eos_id=1, pad_id=0, encoder_targets="response")
    assert torch.equal(full.ids, resp.ids) and torch.equal(full.supervised, resp.supervised)
    start = resp.canvas_start  # one canvas: the response starts right after the prompt
    expected = torch.zeros_like(resp.ar_targets[0])
    expected[start : start + 8] = ~torch.tensor(pins)
    assert torch.equal(resp.ar_targets[0], expected)
    assert full.ar_targets[0, 1:start].all()  # "all" also scores the prompt
    with pytest.raises(ValueError, match="encoder_targets"):
        ObjectiveConfig(encoder_targets="prompt")


def test_noise_depends_only_on_seed_and_draw_index():
    cfg = ObjectiveConfig()
    a = draw_sample(EXAMPLES[0], 17, 3, 8, 512, cfg)
    b = draw_sample(EXAMPLES[0], 17, 3, 8, 512, cfg)
    c = draw_sample(EXAMPLES[0], 18, 3, 8, 512, cfg)
    assert (a.canvas, a.t, a.self_condition) == (b.canvas, b.t, b.self_condition) and torch.equal(a.noise, b.noise)
    assert not torch.equal(a.noise, c.noise)
    assert all(cfg.eps <= draw_sample(EXAMPLES[0], i, 0, 8, 512, cfg).t <= 1 - cfg.eps for i in range(50))


def test_canvas_never_sees_itself_clean_or_later_canvases():
    model = dgemma.build(dgemma.preset("tiny"))
    batch = _batch(model, EXAMPLES)
    cache = model.new_cache(3, batch.ids.shape[1], keep_all=True)
    model.encode(batch.ids, cache, attention_mask=batch.valid)
    before = model.denoise(batch.noisy, cache.prefix(batch.canvas_start))
    ids = batch.ids.clone()
    ids[:, batch.canvas_start :] = torch.randint(3, 512, ids[:, batch.canvas_start :].shape)  # the answer and beyond
    cache2 = model.new_cache(3, ids.shape[1], keep_all=True)
    model.encode(ids, cache2, attention_mask=batch.valid)
    # to rounding: the changed tokens after canvas_start reroute the MoE, so the prefix's expert matmuls run
    # on other row counts (another BLAS path) even though the prefix's values are the same
    after = model.denoise(batch.noisy, cache2.prefix(batch.canvas_start))
    torch.testing.assert_close(after, before, rtol=0, atol=fp32_logit_tolerance(model))
    ids[:, batch.canvas_start - 1] = 7  # ...while the clean prefix does matter
    cache3 = model.new_cache(3, ids.shape[1], keep_all=True)
    model.encode(ids, cache3, attention_mask=batch.valid)
    assert not torch.allclose(before, model.denoise(batch.noisy, cache3.prefix(batch.canvas_start)))


def test_encoder_never_sees_noisy_tokens():
    model = dgemma.build(dgemma.preset("tiny"))
    batch = _batch(model, EXAMPLES)
    cfg = ObjectiveConfig()
    _, parts = block_diffusion_loss(model, batch, cfg)
    batch.noisy = torch.randint(0, 512, batch.noisy.shape)
    _, parts2 = block_diffusion_loss(model, batch, cfg)
    assert parts["encoder_loss"] == parts2["encoder_loss"] and parts["diffusion_loss"] != parts2["diffusion_loss"]


def test_teacher_kl_is_the_frozen_ar_models_distribution_against_the_denoisers():
    """KL(teacher || denoiser) at each canvas position: the teacher's causal next-token distribution of
    the canvas token (from the position before it, over the clean text), against a reference computed on
    whole logits; only the student gets gradients; a zero weight adds nothing and logs nothing."""
    import copy

    from dgemma.train.objective import teacher_kl

    model = dgemma.build(dgemma.preset("tiny"))
    teacher = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():  # a teacher that differs from the student
        for p in teacher.parameters():
            p.mul_(1.1)
    batch, cfg = _batch(model, EXAMPLES), ObjectiveConfig(teacher_kl_weight=0.5, logit_chunk_tokens=5)
    start, c = batch.canvas_start, batch.clean.shape[1]
    cache = model.new_cache(3, batch.ids.shape[1], keep_all=True)
    model.encode(batch.ids, cache, attention_mask=batch.valid)
    hidden = model.denoise_hidden(batch.noisy, cache.prefix(start))
    kl, per_example = teacher_kl(model, hidden, teacher, batch, cfg)
    with torch.no_grad():
        width = start + c - 1
        t_cache, mask = teacher.new_cache(3, width), batch.valid[:, :width]
        t_logits = teacher.encode(batch.ids[:, :width], t_cache, attention_mask=mask, return_logits=True).logits
        t_logits = t_logits[:, start - 1 :]
        p = torch.log_softmax(t_logits, -1)
        q = torch.log_softmax(model.lm_head(hidden), -1)
        per_token = (p.exp() * (p - q)).sum(-1)
        weight = batch.ar_targets[:, start : start + c].float() * batch.supervised.float()
        expected = ((per_token * weight).sum(-1) / weight.sum(-1)).mean()
    torch.testing.assert_close(kl, expected, rtol=1e-4, atol=1e-5)  # chunked against whole: rounding only
    assert float(kl) > 0 and (per_example >= -1e-6).all()
    kl.backward()
    assert model.embed_tokens.weight.grad is not None and teacher.embed_tokens.weight.grad is None
    loss, parts = block_diffusion_loss(model, batch, cfg, teacher)
    base, base_parts = block_diffusion_loss(model, batch, ObjectiveConfig(logit_chunk_tokens=5), teacher)
    assert "teacher_kl" in parts and "teacher_kl" not in base_parts
    torch.testing.assert_close(loss, base + 0.5 * parts["teacher_kl"], rtol=1e-5, atol=1e-5)


def test_pass_one_has_no_gradient_and_zero_signal_is_exactly_zero(monkeypatch):
    model = dgemma.build(dgemma.preset("tiny"))
    seen = []
    original = model.soft_embedding
    monkeypatch.setattr(model, "soft_embedding", lambda logits: seen.append(logits) or original(logits))
    block_diffusion_loss(model, _batch(model, EXAMPLES), ObjectiveConfig())
    assert seen and not seen[0].requires_grad and seen[0].grad_fn is None
    batch = _batch(model, EXAMPLES)
    cache = model.new_cache(3, batch.ids.shape[1], keep_all=True)
    model.encode(batch.ids, cache, attention_mask=batch.valid)
    view = cache.prefix(batch.canvas_start)
    soft = torch.randn(3, 8, 64) * 5
    off = torch.zeros(3, dtype=torch.bool)
    assert torch.equal(
        model.denoise(batch.noisy, view, soft * off.to(soft.dtype)[:, None, None]),  # as the objective masks
        model.denoise(batch.noisy, view),
    )


def test_encoder_loss_matches_full_computation():
    model = dgemma.build(dgemma.preset("tiny"))
    batch = _batch(model, EXAMPLES)
    cache = model.new_cache(3, batch.ids.shape[1], keep_all=True)
    hidden = model.encode(batch.ids, cache, attention_mask=batch.valid).hidden_states
    chunked, per_example = encoder_loss(model, hidden, batch, ObjectiveConfig(logit_chunk_tokens=15))
    logits = model.lm_head(hidden)[:, :-1]
    ce = F.cross_entropy(logits.reshape(-1, 512), batch.ids[:, 1:].reshape(-1), reduction="none").view(3, -1)
    w = batch.ar_targets[:, 1:].float()
    torch.testing.assert_close(per_example, (ce * w).sum(-1) / w.sum(-1))
    torch.testing.assert_close(chunked, ((ce * w).sum(-1) / w.sum(-1)).mean())
    token, _ = encoder_loss(model, hidden, batch, ObjectiveConfig(normalization="token"))
    torch.testing.assert_close(token, (ce * w).sum() / w.sum())


@pytest.mark.parametrize("loss", ["flat", "reweighted", "mean_loo"])
def test_loss_variants_run(loss):
    model = dgemma.build(dgemma.preset("tiny"))
    batch = _batch(model, EXAMPLES)
    value, _ = block_diffusion_loss(model, batch, ObjectiveConfig(loss=loss))
    value.backward()
    assert torch.isfinite(value) and model.layers[0].self_attn.q_proj.weight.grad is not None


def test_objective_config_errors():
    with pytest.raises(ValueError, match="loss must be one of"):
        ObjectiveConfig(loss="elbo")
    with pytest.raises(ValueError, match="eps must be in"):
        ObjectiveConfig(eps=0.7)


# -- data -------------------------------------------------------------------------------------------


def test_chat_records_split_prompt_and_reply(tmp_path):
    tok = make_tokenizer(512)
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]})
        + "\n"
        + json.dumps({"prompt": "2+2", "completion": "4"})
        + "\n"
    )
    examples, counts = load_jsonl(path, tok, vocab_size=512, max_length=64)
    assert counts["records"] == 2
    first = examples[0]
    assert tok.decode(first.prompt) == "<bos><|turn>user\nhi<turn|>\n<|turn>model\n"
    assert tok.decode(first.response) == "hello there<turn|>"
    raw, _ = load_jsonl(path, tok, vocab_size=512, max_length=64, use_chat_template=False)
    assert tok.decode(raw[1].prompt) == "2+2" and tok.decode(raw[1].response) == "4"


def test_truncation_and_skipping(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt_ids": [2, 3], "completion_ids": list(range(10, 40))})
        + "\n"
        + json.dumps({"prompt_ids": list(range(3, 30)), "completion_ids": [5]})
        + "\n"
    )
    examples, counts = load_jsonl(path, vocab_size=512, max_length=20)
    assert counts == {"records": 2, "truncated": 1, "skipped_long_prompt": 1}
    assert examples[0].truncated and len(examples[0].prompt) + len(examples[0].response) == 20


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "bad.jsonl:2: not valid JSON"),
        ('{"prompt": "x"}', "bad.jsonl:2: a record needs"),
        ('{"prompt_ids": [2], "completion_ids": [9999]}', "bad.jsonl:2: 'completion_ids' has token ids outside"),
        ('{"prompt_ids": [], "completion_ids": [5]}', "bad.jsonl:2: 'prompt_ids' must be a non-empty list"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "bad.jsonl:2: the last message must be the assistant"),
        ("[1, 2]", "bad.jsonl:2: each line must be a JSON object"),
    ],
)
def test_malformed_records_name_the_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_ids": [2], "completion_ids": [5]}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        load_jsonl(path, make_tokenizer(512), vocab_size=512, max_length=64)


def test_batch_order_is_a_function_of_the_step():
    first = [batch_indices(s, 4, 10, seed=1) for s in range(5)]
    assert first == [batch_indices(s, 4, 10, seed=1) for s in range(5)]
    draws = [d for step in first for d, _ in step]
    assert draws == list(range(20))
    epoch0 = [e for step in first for _, e in step][:10]
    assert sorted(epoch0) == list(range(10))  # every example once per epoch


# -- configs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, message",
    [
        ({"train": {"stepz": 3}}, "unknown key.*'train'.*stepz"),
        ({"train": {"steps": "ten"}}, "train.steps"),
        ({"model": {"path": "x"}}, "exactly one of 'preset'"),
        ({"optim": {"betas": [0.9]}}, "betas"),
        ({"lora": {"r": "big"}}, "lora.r"),
        ({"bogus": {}}, "unknown section"),
    ],
)
def test_bad_configs(tmp_path, change, message):
    base = {"model": {"preset": "tiny"}, "data": {"train": "x.jsonl"}, "train": {"steps": 1}}
    for k, v in change.items():
        base[k] = {**base.get(k, {}), **v}
    with pytest.raises(ValueError, match=message):
        TrainConfig.from_dict(base)


def test_yaml_errors(tmp_path):
    (tmp_path / "c.yaml").write_text("model: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        TrainConfig.from_yaml(tmp_path / "c.yaml")
    with pytest.raises(FileNotFoundError):
        TrainConfig.from_yaml(tmp_path / "missing.yaml")


# -- the trainer -----------------------------------------------------------------------------------


def test_loss_decreases_and_resume_is_exact(tmp_path):
    cfg = _config(tmp_path, train={"steps": 24, "save_every": 8})
    full = train(cfg, progress=False)
    assert sum(full.losses[-4:]) / 4 < sum(full.losses[:4]) / 4 - 1.0
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 25)) and log[0]["lr"] < log[2]["lr"]  # warmup
    cfg.train.out_dir = str(tmp_path / "resumed")
    part = train(cfg, progress=False, stop_after=10)
    rest = train(cfg, progress=False)
    assert part.losses + rest.losses == full.losses  # bit for bit
    assert sorted(p.name for p in (tmp_path / "resumed").glob("checkpoint-*")) == ["checkpoint-16", "checkpoint-24"]
    assert not list((tmp_path / "resumed").glob(".*"))  # no temporary files left
    trained = dgemma.load(full.final_dir)
    assert trained.generation_config is not None and trained.config.canvas_length == 8


def test_router_is_frozen_and_optimizer_skips_it(tmp_path):
    cfg = _config(tmp_path, train={"steps": 2})
    result = train(cfg, progress=False)
    trained = dgemma.load(result.final_dir)
    fresh = dgemma.build(dgemma.preset("tiny"), seed=0)
    assert torch.equal(trained.layers[0].router.proj.weight, fresh.layers[0].router.proj.weight)
    assert not torch.equal(trained.layers[0].self_attn.q_proj.weight, fresh.layers[0].self_attn.q_proj.weight)


def test_nan_stops_with_a_clear_message(tmp_path, monkeypatch):
    cfg = _config(tmp_path, train={"steps": 6, "save_every": 2})
    import dgemma.train.trainer as trainer

    real = trainer.block_diffusion_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        loss, parts = real(*args, **kwargs)
        if calls["n"] > 3:
            loss = loss * float("nan")
            parts["loss"] = float("nan")
        return loss, parts

    monkeypatch.setattr(trainer, "block_diffusion_loss", poisoned)
    with pytest.raises(TrainingDiverged, match=r"step 4: the loss is nan.*checkpoint-2"):
        train(cfg, progress=False)
    assert (tmp_path / "run" / "latest").read_text() == "checkpoint-2"


def test_lora_on_transformers_checkpoint(moe_ckpt, tmp_path):
    """LoRA training resumes exactly, merged equals unmerged, and the adapter carries the base's NOTICE."""
    base_dir = tmp_path / "base"
    shutil.copytree(moe_ckpt[0], base_dir)
    (base_dir / "NOTICE").write_text("terms of the base weights\n")
    cfg = _config(
        tmp_path,
        model={"preset": None, "path": str(base_dir)},
        lora={"r": 4, "alpha": 8},
        train={"steps": 4, "save_every": 2},
        optim={"lr": 1e-2},
    )
    cfg.model.preset = None
    full = train(cfg, progress=False)
    assert (full.final_dir / "adapter_model.safetensors").is_file()
    assert (full.final_dir / "NOTICE").read_text() == "terms of the base weights\n"
    cfg.train.out_dir = str(tmp_path / "again")
    assert train(cfg, progress=False, stop_after=2).losses + train(cfg, progress=False).losses == full.losses
    # merged and unmerged give the same outputs
    base = load_quiet(moe_ckpt[0])
    unmerged = load_adapter(load_quiet(moe_ckpt[0]), full.final_dir, merge=False)
    merged = load_adapter(base, full.final_dir, merge=True)
    ids, canvas = torch.tensor([[5, 6, 7, 8]]), torch.randint(0, 512, (1, 8))
    outs = []
    for m in (unmerged, merged):
        with torch.no_grad():
            cache = m.new_cache(1, 16)
            m.encode(ids, cache)
            outs.append(m.denoise(canvas, cache))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(outs[1], load_quiet(moe_ckpt[0]).denoise(canvas, _cache(load_quiet(moe_ckpt[0]), ids)))


def _cache(model, ids):
    cache = model.new_cache(1, 16)
    model.encode(ids, cache)
    return cache


def test_lora_targets_and_errors():
    model = dgemma.build(dgemma.preset("tiny"))
    peft_model = apply_lora(model, r=2, alpha=4)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("self_attn.q_proj" in n for n in trainable) and any("mlp.down_proj" in n for n in trainable)
    assert not any("experts" in n or "router" in n or "self_conditioning" in n for n in trainable)
    with pytest.raises(ValueError, match="LoRA targets"):
        apply_lora(dgemma.build(dgemma.preset("tiny")), targets=["everything"])
    with pytest.raises(FileNotFoundError, match="not a LoRA adapter"):
        load_adapter(dgemma.build(dgemma.preset("tiny")), ROOT)


def test_cli_trains_from_scratch_and_generate_loads_it(tmp_path, capsys):
    from dgemma.cli import main

    tok_dir = tmp_path / "tok"
    make_tokenizer(512).save(tok_dir)
    data = tmp_path / "text.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"count {i}", "completion": " ".join(str(i + k) for k in range(6))}) + "\n"
            for i in range(20)
        )
    )
    (tmp_path / "cfg.yaml").write_text(
        "model: {preset: tiny}\n"
        f"data: {{train: {data.name}, tokenizer: tok, max_length: 96}}\n"
        "train: {steps: 3, batch_size: 2, out_dir: run, save_every: 3}\n"
    )
    assert main(["train", str(tmp_path / "cfg.yaml")]) == 0
    assert (
        main(
            [
                "generate",
                "-m",
                str(tmp_path / "run" / "final"),
                "-p",
                "count 3",
                "--max-new-tokens",
                "6",
                "--max-denoising-steps",
                "2",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] <= 6
    assert main(["merge", str(tmp_path / "run" / "final"), str(tmp_path), str(tmp_path / "m")]) == 2
    assert "not a LoRA adapter directory" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo on Linux")
@pytest.mark.parametrize(("preset", "steps"), [("tiny-dense", 3), ("tiny", 1)])
def test_two_processes_match_one(tmp_path, preset, steps):
    """FSDP2 data parallel over two processes trains what one process trains, where that is well defined.

    The all-reduce sums the two half-batch gradients in another order: rounding-level differences. Adam's
    first steps are about sign(g) * lr, so rounding noise in a near-zero gradient element becomes an
    lr-sized weight difference; in a dense model such elements barely move the loss, so it stays equal to
    rounding over several steps. In the MoE, those weights can move a token across a top-k routing tie,
    and the loss then jumps by ~1e-3 (8.9e-4 by step 3 on an AMD EPYC): only its first loss, computed
    before any update, is compared.
    """
    import yaml

    cfg = _config(tmp_path, model={"preset": preset}, train={"steps": steps, "save_every": steps, "out_dir": "single"})
    single = train(cfg, progress=False)
    data = cfg.to_dict()
    data.pop("lora")
    data["train"]["out_dir"] = str(tmp_path / "double")
    data["data"]["train"] = str(tmp_path / "toy.jsonl")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "-m",
            "dgemma.cli",
            "train",
            str(tmp_path / "cfg.yaml"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    log = [json.loads(line)["loss"] for line in (tmp_path / "double" / "log.jsonl").read_text().splitlines()]
    assert len(log) == steps
    # a loss of ~12 reduced over two half batches in another order: 1e-5 is ~10 fp32 ulps of it, far
    # below what another batch or other noise draws would change
    torch.testing.assert_close(torch.tensor(log), torch.tensor(single.losses), rtol=0, atol=1e-5)


def test_cli_lora_on_transformers_checkpoint_then_generate_with_adapter(moe_ckpt, tmp_path, capsys):
    import shutil

    from dgemma.cli import main

    base = tmp_path / "base"
    shutil.copytree(moe_ckpt[0], base)
    make_tokenizer(512).save(base)
    _toy_jsonl(tmp_path / "toy.jsonl")
    (tmp_path / "lora.yaml").write_text(
        "model: {path: base}\n"
        "data: {train: toy.jsonl, max_length: 64}\n"
        "lora: {r: 4, alpha: 8}\n"
        "train: {steps: 2, batch_size: 2, out_dir: run, save_every: 1, keep_checkpoints: 1}\n"
    )
    assert main(["train", str(tmp_path / "lora.yaml")]) == 0
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-2"]
    assert main(["train", str(tmp_path / "lora.yaml"), "--steps", "3"]) == 0  # resumes at step 2
    assert "resumed from" in capsys.readouterr().err
    args = ["-p", "hi", "--max-new-tokens", "4", "--max-denoising-steps", "2", "--json"]
    assert main(["generate", "-m", str(base), "--adapter", str(tmp_path / "run" / "final"), *args]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] <= 4
    assert main(["merge", str(base), str(tmp_path / "run" / "final"), str(tmp_path / "merged")]) == 0
    assert main(["generate", "-m", str(tmp_path / "merged"), *args]) == 0
    flags = ["--model", str(base), "--adapter", str(tmp_path / "run" / "final"), "--out", str(tmp_path / "m2")]
    assert main(["merge", *flags]) == 0  # the same with the flags every command takes
    merged = (tmp_path / "merged" / "model.safetensors").read_bytes()
    assert (tmp_path / "m2" / "model.safetensors").read_bytes() == merged
    assert main(["merge", "--model", str(base)]) == 2 and "--adapter, --out" in capsys.readouterr().err


def test_gradient_checkpointing_gives_the_same_gradients():
    grads = []
    for recompute in (False, True):
        model = dgemma.build(dgemma.preset("tiny"), seed=0).train()
        model.gradient_checkpointing = recompute
        loss, _ = block_diffusion_loss(model, _batch(model, EXAMPLES), ObjectiveConfig())
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    # The dense preset: micro-batches sum gradients in another order (rounding-level differences), Adam's
    # first steps are ~sign(g)·lr, and on a MoE a token near a top-k tie then flips experts and the loss jumps
    # (see test_two_processes_match_one); a dense model's loss is smooth in its weights, so rounding stays rounding.
    dense = {"preset": "tiny-dense"}
    whole = train(_config(tmp_path, model=dense, train={"steps": 3, "out_dir": "a"}), progress=False)
    split = train(
        _config(tmp_path, model=dense, train={"steps": 3, "out_dir": "b", "micro_batch_size": 1}), progress=False
    )
    torch.testing.assert_close(torch.tensor(split.losses), torch.tensor(whole.losses), rtol=1e-5, atol=1e-5)


def test_a_misspelt_model_override_is_refused(tmp_path):
    cfg = _config(tmp_path, model={"preset": "tiny", "overrides": {"hiden_size": 32}})
    with pytest.raises(ValueError, match="'hiden_size' is not a text_config field; did you mean 'hidden_size'"):
        train(cfg, progress=False)
