"""Stage 2: reinforcement learning combined with sampler distillation, from a stage-1 checkpoint.

`dgemma train CONFIG.yaml` runs this when the config has a `stage2:` section (recipes/*-stage2.yaml). Each
step samples rollouts, scores them with a verifier, and trains on GRPO (rl.py) plus distillation
(distill.py); the step is handed to the shared loop (trainer.loop). Details: docs/stage2.md, "One step"
and "How the code is laid out".
"""

from __future__ import annotations

import copy
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model.model import DiffusionGemma
from . import distributed
from .config import TrainConfig
from .data import Example, batch_indices
from .distill import Trajectory, distillation_loss, pins_for, rollout, teacher_targets
from .distributed import print0
from .objective import fill_token
from .rl import REWARDS, corrupt, group_advantages, grpo_loss, reward_stats, token_logprobs
from .trainer import StepResult, TrainResult, append_log, load_data, loop, prepare, start_run


def _seed(*parts: int) -> int:
    value = 0
    for p in parts:
        value = (value * 1_000_003 + p) % (2**61)
    return value


def evaluate_policy(model, examples, reward, cfg: TrainConfig, n: int, seed: int) -> dict[str, float]:
    """The student's sampler on the first `n` evaluation records: mean reward, solve rate, mean steps per
    canvas and tokens per forward."""
    model.eval()
    c = model.config.canvas_length
    chosen = examples[:n]
    results = {"reward": [], "steps": [], "tpf": []}
    for a in range(0, len(chosen), 32):
        part = chosen[a : a + 32]
        pins = pins_for([e.pinned for e in part], [e.response for e in part], c)
        runs = rollout(model, [e.prompt for e in part], pins, record=False, seed=seed, **cfg.stage2.sampling)
        for e, r in zip(part, runs, strict=True):
            results["reward"].append(reward(r.prompt, r.final, e.response[:c]))
            results["steps"].append(r.steps)
            results["tpf"].append(r.tokens_per_forward)
    stats = reward_stats(results["reward"])
    return {
        "eval_reward": stats["reward"],
        "eval_solved": stats["solved"],
        "eval_steps": statistics.fmean(results["steps"]),
        "eval_tokens_per_forward": statistics.fmean(results["tpf"]),
    }


@dataclass
class _Stage2:
    """What a stage-2 step needs: the student, the frozen stage-1 model, the verifier and the records."""

    cfg: TrainConfig
    model: DiffusionGemma
    reference: DiffusionGemma  # the teacher and the KL anchor
    reward: object  # (prompt, canvas, reference) -> score in [0, 1]
    examples: list[Example]
    device: torch.device


def _step(s: _Stage2, step: int) -> StepResult:
    """Stage 2's step: rollouts of the student, scored; the distillation and GRPO terms; backward."""
    s2, c = s.cfg.stage2, s.model.config.canvas_length
    seed = _seed(s.cfg.train.seed, step)
    chosen = [s.examples[e] for _, e in batch_indices(step, s2.prompts_per_step, len(s.examples), s.cfg.train.seed)]
    prompts = [e.prompt for e in chosen]
    references = [canvas_reference(e.response, c, s.model.text_config) for e in chosen]
    pins = pins_for([e.pinned for e in chosen], [e.response for e in chosen], c)
    g = s2.group_size
    s.model.eval()
    group_prompts = [p for p in prompts for _ in range(g)]
    runs = rollout(s.model, group_prompts, pins.repeat_interleave(g, 0), seed=seed, **s2.sampling)
    rewards = [s.reward(r.prompt, r.final, references[i // g]) for i, r in enumerate(runs)]
    record: dict = reward_stats(rewards)
    record["steps_per_canvas"] = statistics.fmean(r.steps for r in runs)
    record["tokens_per_forward"] = statistics.fmean(r.tokens_per_forward for r in runs)
    s.model.train()
    loss = torch.zeros((), device=s.device)
    if s2.distill_weight > 0:
        per_run = _distill_targets(s, prompts, pins, references, runs, rewards, seed, record)
        distill, used = distillation_loss(
            s.model,
            runs,
            per_run,
            states_per_trajectory=s2.states_per_trajectory,
            generator=torch.Generator().manual_seed(seed),
        )
        loss = loss + s2.distill_weight * distill
        record["distill_loss"] = float(distill.detach())
        record["distill_states"] = used
    rl = _rl_term(s, group_prompts, runs, rewards, seed, record) if s2.rl_weight > 0 else None
    if rl is not None:
        loss = loss + s2.rl_weight * rl
    if loss.requires_grad:  # else no verified rollout and no advantage: nothing to learn, the schedule moves on
        loss.backward()
    return StepResult(float(loss.detach()), record)


def canvas_reference(response: list[int], canvas: int, text) -> list[int]:
    """The first canvas of a record's response, as stage 1 trains it: a response shorter than the canvas
    (a file's last lines) is filled with end-of-text tokens, so every reference has the canvas's length."""
    return response[:canvas] + [fill_token(text)] * (canvas - len(response))


def _distill_targets(s: _Stage2, prompts, pins, references, runs: list[Trajectory], rewards, seed, record) -> list:
    """Each rollout's distillation target (None: none this step), as stage2.distill_target chooses."""
    s2, g = s.cfg.stage2, s.cfg.stage2.group_size
    if s2.distill_target == "teacher":
        targets, teacher_rewards = teacher_targets(
            s.reference, prompts, pins, references, s.reward, s2.target_threshold, seed=seed, **s2.teacher_sampling
        )
        for i in range(len(prompts)):  # the teacher failed: a verified group member instead
            if targets[i] is None:
                best = max(range(i * g, (i + 1) * g), key=lambda k: rewards[k])
                if rewards[best] >= s2.target_threshold:
                    targets[i] = runs[best].final
        record["teacher_solved"] = sum(w >= s2.target_threshold for w in teacher_rewards) / len(prompts)
        return [targets[i // g] for i in range(len(runs))]
    if s2.distill_target == "reference":  # the record's answer, from every state of every rollout
        return [references[i // g] for i in range(len(runs))]
    # each verified rollout's own end: from every state it visited, predict where it arrived
    return [r.final if w >= s2.target_threshold else None for r, w in zip(runs, rewards, strict=True)]


def _rl_term(s: _Stage2, group_prompts, runs: list[Trajectory], rewards, seed, record) -> torch.Tensor | None:
    """The GRPO loss of the rollouts (None when no rollout scores differently from its group)."""
    s2 = s.cfg.stage2
    advantages = group_advantages(torch.tensor(rewards), s2.group_size)
    if not bool((advantages != 0).any()):
        return None
    canvases = torch.tensor([r.final for r in runs])
    pinned = torch.stack([r.pinned for r in runs])
    vocab = s.model.text_config.vocab_size
    corruption = corrupt(canvases, pinned, vocab, torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        ref_logp = token_logprobs(s.reference, group_prompts, canvases, corruption)
    logp = token_logprobs(s.model, group_prompts, canvases, corruption)
    # One update per batch of rollouts: the rollout-time policy is the current one, so the ratio starts
    # at 1 (the clip bounds it if more updates per batch are ever made).
    rl, parts = grpo_loss(
        logp,
        logp.detach(),
        ref_logp,
        advantages.to(s.device),
        corruption.scored.to(s.device),
        clip=s2.clip,
        kl_coef=s2.kl_coef,
    )
    record |= parts
    return rl


def _summary(record: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in record.items() if k not in ("step", "final"))


def train_stage2(cfg: TrainConfig, *, progress: bool | None = None, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) stage 2 as `cfg` describes; returns where the model went."""
    if cfg.model.path is None:
        raise ValueError("stage 2 starts from a trained model: set model.path to a stage-1 checkpoint")
    if distributed.is_launched():  # each process would train on its own and write the same files
        raise ValueError("stage 2 runs in one process: start it with `dgemma train CONFIG`, not torchrun")
    model, tokenizer, device = prepare(cfg, multi_process=False)
    if tokenizer is None:
        raise ValueError("stage 2 needs the task's tokenizer (data.tokenizer, or tokenizer.json in model.path)")
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    c = model.config.canvas_length
    examples, eval_examples, counts = load_data(cfg, tokenizer, model)
    long = [e.line for e in examples if len(e.response) > c]
    if long:
        raise ValueError(
            f"stage 2 uses single-canvas records; {len(long)} responses exceed {c} tokens (line {long[0]})"
        )
    held_out = f", {len(eval_examples)} for evaluation" if eval_examples else ""
    print0(f"data: {len(examples)} records ({counts}){held_out}")
    s = _Stage2(cfg, model, reference, REWARDS[cfg.stage2.reward](tokenizer), examples, device)
    run = start_run(cfg, model, tokenizer)

    def evaluate() -> dict:
        return evaluate_policy(model, eval_examples, s.reward, cfg, cfg.stage2.eval_prompts, cfg.train.seed)

    def report_final(metrics: dict) -> None:
        record = {"step": cfg.train.steps, "final": True} | metrics
        print0("after stage 2: " + _summary(record))
        append_log(run.log_path, record)

    if run.start == 0 and eval_examples:  # the stage-1 model's scores, as step 0
        record = {"step": 0} | evaluate()
        print0("before stage 2: " + _summary(record))
        append_log(run.log_path, record)
    return loop(
        run,
        lambda step: _step(s, step),
        evaluate=evaluate if eval_examples else None,
        report_final=report_final,
        progress=progress,
        stop_after=stop_after,
    )


def log_records(out_dir: Path) -> list[dict]:
    """The records of a stage-2 run's log."""
    path = Path(out_dir) / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]
