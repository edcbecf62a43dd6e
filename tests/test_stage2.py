"""Stage 2 (RL + sampler distillation): rewards, advantages, the losses, rollouts, and the trainer end to end
(with an exact resume), on the shipped Sudoku model and puzzles generated here."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

import dgemma
from dgemma.tasks import sudoku
from dgemma.train import rl
from dgemma.train.config import TrainConfig
from dgemma.train.distill import distillation_loss, pins_for, rollout
from dgemma.train.stage2 import log_records, train_stage2

SOLVED = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"


@pytest.fixture(scope="module")
def sudoku_model():
    return sudoku.load_model()


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """Easy puzzles in the training-record format (train 12, eval 6)."""
    d = tmp_path_factory.mktemp("stage2_data")
    tok = sudoku.make_tokenizer()
    tok.save(d / "tokenizer")
    for name, seeds in (("train", range(12)), ("eval", range(100, 106))):
        puzzles = [sudoku.generate_level("easy", s) for s in seeds]
        (d / f"{name}.jsonl").write_text("".join(p.to_json() + "\n" for p in puzzles))
        sudoku.to_training_jsonl(d / f"{name}.jsonl", d / f"{name}-records.jsonl", tok)
    return d


def test_sudoku_reward_grades_solutions():
    tok = sudoku.make_tokenizer()
    reward = rl.sudoku_reward(tok)
    puzzle = "0" + SOLVED[1:]
    prompt = sudoku.prompt_ids(tok, puzzle)
    assert reward(prompt, sudoku.solution_ids(tok, SOLVED)) == 1.0
    swapped = SOLVED[1] + SOLVED[0] + SOLVED[2:]  # breaks a clue (position 1) and units
    assert reward(prompt, sudoku.solution_ids(tok, swapped)) == 0.0
    wrong_blank = "6" + SOLVED[1:]  # clues kept, the blank wrong: row, column and box broken
    assert reward(prompt, sudoku.solution_ids(tok, wrong_blank)) == pytest.approx(0.5 * 24 / 27)


def test_match_reward():
    reward = rl.match_reward()
    assert reward([1], [5, 6, 7, 8], [5, 6, 7, 8]) == 1.0
    assert reward([1], [5, 6, 0, 0], [5, 6, 7, 8]) == 0.25
    with pytest.raises(ValueError, match="reference"):
        reward([1], [5], None)


def test_group_advantages():
    adv = rl.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5]), 2)
    assert adv[:4].tolist() == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-4)
    assert adv[4:].tolist() == [0.0, 0.0]  # a group that scored alike teaches nothing
    with pytest.raises(ValueError, match="groups"):
        rl.group_advantages(torch.ones(5), 2)


def test_grpo_loss_pushes_likelihood_along_the_advantage():
    logits = torch.zeros(2, 3, requires_grad=True)
    logp = torch.log_softmax(logits, -1)  # [2 canvases, 3 positions] stand-ins for token log-probs
    scored = torch.ones(2, 3, dtype=torch.bool)
    loss, parts = rl.grpo_loss(logp, logp.detach(), None, torch.tensor([1.0, -1.0]), scored, kl_coef=0.0)
    loss.backward()
    assert (logits.grad[0] < 0).sum() >= 1 and parts["clip_fraction"] == 0.0  # descent raises row 0's logp
    # The clip: a ratio already above 1 + clip gives no gradient for a positive advantage.
    lp = torch.zeros(1, 2, requires_grad=True)
    loss, parts = rl.grpo_loss(lp, lp.detach() - 1.0, None, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool))
    loss.backward()
    assert torch.all(lp.grad == 0) and parts["clip_fraction"] == 1.0
    # KL to the reference is zero at the reference and positive away from it.
    same = torch.zeros(1, 2)
    assert rl.grpo_loss(same, same, same, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))[1]["kl"] == 0.0
    assert rl.grpo_loss(same, same, same - 1, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool))[1]["kl"] > 0


def test_corruption_spares_pinned_positions():
    canvases = torch.randint(0, 15, (64, 81))
    pinned = torch.rand(64, 81) < 0.4
    c = rl.corrupt(canvases, pinned, 15, torch.Generator().manual_seed(0))
    assert torch.equal(c.noisy[pinned], canvases[pinned]) and torch.equal(c.scored, ~pinned)
    assert (c.noisy != canvases).any()


def test_rollout_records_the_sampler_states(sudoku_model):
    model, tok = sudoku_model
    puzzles = [sudoku.generate_level("easy", s).puzzle for s in (1, 2)]
    prompts = [sudoku.prompt_ids(tok, p) for p in puzzles]
    templates = torch.tensor([[-1 if t is None else t for t in sudoku.template(tok, p)] for p in puzzles])
    runs = rollout(model, prompts, templates, max_denoising_steps=6, seed=0)
    for run, template in zip(runs, templates, strict=True):
        assert len(run.states) == run.steps == len(run.signals) and 1 <= run.steps <= 6
        assert run.signals[0] is None and all(s is not None for s in run.signals[1:])  # self-conditioning
        for state in run.states:  # every state the model saw keeps the clues
            assert torch.equal(state[template >= 0], template[template >= 0])
        assert run.tokens_per_forward == pytest.approx(float((template < 0).sum()) / run.steps)
    # The same seed, the same run; the rows of a batch are independent of recording.
    again = rollout(model, prompts, templates, max_denoising_steps=6, seed=0, record=False)
    assert [r.final for r in again] == [r.final for r in runs]


def test_distillation_loss_learns_its_targets(sudoku_model):
    model, tok = sudoku_model
    model = type(model)(model.config).to(torch.float32)  # a fresh copy to train
    model.load_state_dict(sudoku_model[0].state_dict())
    p = sudoku.generate_level("easy", 7)
    pins = pins_for([[int(ch != "0") for ch in p.puzzle]], [sudoku.solution_ids(tok, p.solution)], 81)
    runs = rollout(model, [sudoku.prompt_ids(tok, p.puzzle)], pins, max_denoising_steps=4, seed=0)
    target = [sudoku.solution_ids(tok, p.solution)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    first = None
    for _ in range(5):
        loss, used = distillation_loss(model, runs, target, generator=torch.Generator().manual_seed(0))
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert used == min(4, len(runs[0].states)) and float(loss.detach()) < first
    assert distillation_loss(model, runs, [None])[1] == 0  # no target, nothing to learn


def _config(records, out_dir, **stage2):
    data = {
        "model": {"path": str(sudoku.MODEL_DIR)},
        "data": {
            "train": str(records / "train-records.jsonl"),
            "eval": str(records / "eval-records.jsonl"),
            "tokenizer": str(records / "tokenizer"),
            "max_length": 200,
        },
        "optim": {"lr": 1e-4, "warmup_steps": 1},
        "train": {"steps": 2, "seed": 0, "out_dir": str(out_dir), "save_every": 1, "eval_every": 0},
        "stage2": {
            "prompts_per_step": 3,
            "group_size": 2,
            "sampling": {"max_denoising_steps": 4},
            "teacher_sampling": {"sampler": "fixed", "tokens_per_step": 8, "max_denoising_steps": 8},
            "eval_prompts": 4,
        }
        | stage2,
    }
    return TrainConfig.from_dict(data)


def test_stage2_trains_logs_and_resumes_exactly(records, tmp_path):
    straight = train_stage2(_config(records, tmp_path / "a"), progress=False)
    log = log_records(tmp_path / "a")
    assert log[0]["step"] == 0 and "eval_solved" in log[0]  # the stage-1 baseline
    steps = [r for r in log if r["step"] >= 1 and "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in ("reward", "solved", "steps_per_canvas", "tokens_per_forward", "distill_loss", "loss", "lr"):
            assert key in r, key
    assert log[-1].get("final") and "eval_tokens_per_forward" in log[-1]
    assert (straight.final_dir / "model.safetensors").is_file()

    cfg = _config(records, tmp_path / "b")
    train_stage2(cfg, progress=False, stop_after=1)  # interrupted after step 1
    resumed = train_stage2(_config(records, tmp_path / "b"), progress=False)
    a = dgemma.load(straight.final_dir).state_dict()
    b = dgemma.load(resumed.final_dir).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in log_records(tmp_path / "b") if "loss" in r] == [r["loss"] for r in steps]


def test_stage2_progress_bar_runs(records, tmp_path, capsys):
    """The bar shows what stage 2 counts (it asked for stage 1's tokens/s and crashed on a terminal)."""
    result = train_stage2(_config(records, tmp_path / "p"), progress=True, stop_after=1)
    assert result.steps == 1 and "1/" in capsys.readouterr().err


def test_stage2_refuses_torchrun(records, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets: every process would write the same files
    with pytest.raises(ValueError, match="stage 2 runs in one process"):
        train_stage2(_config(records, tmp_path / "t"), progress=False)


def test_stage2_cli_and_config_errors(records, tmp_path, capsys):
    from dgemma.cli import main

    cfg = _config(records, tmp_path / "c").to_dict()
    cfg["train"]["steps"] = 1
    cfg["stage2"]["rl_weight"] = 1.0
    cfg["stage2"]["distill_weight"] = 0.0
    cfg.pop("lora")
    path = tmp_path / "stage2.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path)]) == 0
    assert "model:" in capsys.readouterr().err
    teacher = dict(cfg, stage2=dict(cfg["stage2"], distill_target="teacher", rl_weight=0.0, distill_weight=1.0))
    teacher["train"] = dict(cfg["train"], out_dir=str(tmp_path / "d"))
    path.write_text(yaml.safe_dump(teacher))
    assert main(["train", str(path)]) == 0
    assert "teacher_solved" in log_records(tmp_path / "d")[1]
    bad = dict(cfg, stage2=dict(cfg["stage2"], reward="chess"))
    path.write_text(yaml.safe_dump(bad))
    assert main(["train", str(path)]) == 2
    assert "stage2.reward" in capsys.readouterr().err
    bad = dict(cfg, stage2=dict(cfg["stage2"], group_size=1))
    path.write_text(yaml.safe_dump(bad))
    assert main(["train", str(path)]) == 2
    assert "group_size" in capsys.readouterr().err
    bad = dict(cfg, stage2=dict(cfg["stage2"], distill_target="oracle"))
    path.write_text(yaml.safe_dump(bad))
    assert main(["train", str(path)]) == 2
    assert "distill_target" in capsys.readouterr().err
    assert json.loads((tmp_path / "c" / "log.jsonl").read_text().splitlines()[-1])["step"] == 1


def test_null_optional_sections_stay_absent(records, tmp_path):
    cfg = _config(records, tmp_path / "e").to_dict()
    cfg["stage2"] = None
    again = TrainConfig.from_dict(cfg)
    assert again.stage2 is None and again.lora is None
    assert TrainConfig.from_dict(again.to_dict()).stage2 is None


def test_a_step_with_nothing_to_learn_still_advances(records, tmp_path, monkeypatch):
    import dgemma.train.stage2 as stage2

    # Every canvas scores 0: no advantage, no verified target, so no gradient at all this step.
    monkeypatch.setitem(stage2.REWARDS, "sudoku", lambda tok: lambda *a: 0.0)
    cfg = _config(records, tmp_path / "f")
    cfg.train.steps = 1
    train_stage2(cfg, progress=False)
    step = next(r for r in log_records(tmp_path / "f") if r["step"] == 1 and "loss" in r)
    assert step["grad_norm"] == 0.0 and step["reward"] == 0.0 and step["distill_states"] == 0
    # With reference targets the same step still distils: every rollout toward its record's completion.
    cfg = _config(records, tmp_path / "g", distill_target="reference")
    cfg.train.steps = 1
    train_stage2(cfg, progress=False)
    step = next(r for r in log_records(tmp_path / "g") if r["step"] == 1 and "loss" in r)
    assert step["reward"] == 0.0 and step["grad_norm"] > 0 and step["distill_states"] >= 3 * 2


def test_short_responses_are_filled_as_stage_1_fills_them(records, tmp_path):
    """A record whose response is shorter than the canvas (a code file's last lines) is filled with
    end-of-text tokens, as the stage-1 trainer fills it: the match reward and the `reference` distillation
    then compare whole canvases (this used to stop training on a ragged tensor)."""
    from dgemma.train.stage2 import canvas_reference

    text = dgemma.load(sudoku.MODEL_DIR).text_config
    eos = text.eos_token_ids[0]
    assert canvas_reference([7, 8, 9], 5, text) == [7, 8, 9, eos, eos]
    assert canvas_reference(list(range(8)), 5, text) == [0, 1, 2, 3, 4]  # a longer one: its first canvas
    lines = (records / "train-records.jsonl").read_text().splitlines()[:3]
    short = json.loads(lines[1])
    short["completion_ids"] = short["completion_ids"][:30]
    short.pop("pinned", None)
    lines[1] = json.dumps(short)
    data = tmp_path / "short-records.jsonl"
    data.write_text("\n".join(lines) + "\n")
    cfg = _config(records, tmp_path / "run", reward="match", distill_target="reference")
    cfg.data.train = str(data)
    train_stage2(cfg, progress=False)
    steps = [r for r in log_records(tmp_path / "run") if r["step"] >= 1 and "reward" in r]
    assert len(steps) == 2 and all(r["distill_states"] > 0 for r in steps)
