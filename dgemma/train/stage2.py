"""Stage 2: reinforcement learning combined with sampler distillation, from a stage-1 checkpoint.

`dgemma train CONFIG.yaml` runs this when the config has a `stage2:` section (recipes/*-stage2.yaml).
Each step:

1. draws `prompts_per_step` training records (prompt, completion, pinned positions);
2. samples `group_size` canvases per prompt with the model's own sampler (`stage2.sampling`), recording
   every state the sampler gave the model (distill.rollout);
3. scores each canvas with the verifier (`stage2.reward`, see rl.REWARDS) and turns the scores into
   group-standardised advantages;
4. picks distillation targets: each rollout's own final canvas where the verifier gives it full credit
   (`distill_target: final`), or the canvas of a teacher (the frozen stage-1 model run with the slower
   `teacher_sampling`; `distill_target: teacher`), where the verifier accepts it;
5. loss = rl_weight x clipped policy-gradient loss with a KL penalty to the stage-1 model (rl.grpo_loss,
   on a forward-process likelihood estimate) + distill_weight x cross-entropy at the recorded sampler
   states against the targets (distill.distillation_loss); one AdamW step.

It logs reward, solve rate, steps per canvas and tokens per forward of the student's rollouts, the
teacher's success rate, the losses, KL and clip fraction (out_dir/log.jsonl), evaluates on `data.eval`
every `train.eval_every` steps and at the end, and checkpoints and resumes exactly like stage 1 (every
random draw is a function of the seed and the step).
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from .config import TrainConfig
from .data import batch_indices, load_jsonl
from .distill import distillation_loss, pins_for, rollout, teacher_targets
from .rl import REWARDS, corrupt, group_advantages, grpo_loss, reward_stats, token_logprobs
from .trainer import (
    TrainingDiverged,
    TrainResult,
    _build_model,
    _export_final,
    _log,
    _optimizer,
    _ProgressBar,
    _resume,
    _save_checkpoint,
    _truncate_log,
)


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


def train_stage2(cfg: TrainConfig, *, progress: bool | None = None, stop_after: int | None = None) -> TrainResult:
    """Run (or resume) stage 2 as `cfg` describes; returns where the model went."""
    s2 = cfg.stage2
    if cfg.model.path is None:
        raise ValueError("stage 2 starts from a trained model: set model.path to a stage-1 checkpoint")
    device = torch.device(cfg.train.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out_dir = cfg.resolve(cfg.train.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.train.seed)
    model, tokenizer = _build_model(cfg, device)
    if tokenizer is None:
        raise ValueError("stage 2 needs the task's tokenizer (data.tokenizer, or tokenizer.json in model.path)")
    reference = copy.deepcopy(model).eval().requires_grad_(False)  # the teacher and the KL anchor
    c, vocab = model.config.canvas_length, model.text_config.vocab_size
    reward = REWARDS[s2.reward](tokenizer)
    examples, counts = load_jsonl(
        cfg.resolve(cfg.data.train), tokenizer, vocab_size=vocab, max_length=cfg.data.max_length
    )
    eval_examples = None
    if cfg.data.eval:
        eval_examples, _ = load_jsonl(
            cfg.resolve(cfg.data.eval), tokenizer, vocab_size=vocab, max_length=cfg.data.max_length
        )
    long = [e.line for e in examples if len(e.response) > c]
    if long:
        raise ValueError(
            f"stage 2 uses single-canvas records; {len(long)} responses exceed {c} tokens (line {long[0]})"
        )
    _log(
        f"data: {len(examples)} records ({counts})"
        + (f", {len(eval_examples)} for evaluation" if eval_examples else "")
    )

    for layer in model.layers:
        if layer.router is not None and cfg.train.freeze_router:
            layer.router.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer, scheduler = _optimizer(cfg, params)
    start = _resume(cfg, out_dir, model, optimizer, scheduler)
    log_path = out_dir / "log.jsonl"
    _truncate_log(log_path, start)
    if start == 0 and eval_examples:
        record = {"step": 0} | evaluate_policy(model, eval_examples, reward, cfg, s2.eval_prompts, cfg.train.seed)
        _log("before stage 2: " + ", ".join(f"{k} {v:.3f}" for k, v in record.items() if k != "step"))
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    show = progress if progress is not None else sys.stderr.isatty()
    bar = _ProgressBar(cfg.train.steps, start) if show else None
    losses: list[float] = []
    end = cfg.train.steps if stop_after is None else min(cfg.train.steps, start + stop_after)
    for step in range(start, end):
        t0 = time.perf_counter()
        seed = _seed(cfg.train.seed, step)
        pairs = batch_indices(step, s2.prompts_per_step, len(examples), cfg.train.seed)
        chosen = [examples[e] for _, e in pairs]
        prompts = [e.prompt for e in chosen]
        references = [e.response[:c] for e in chosen]
        pins = pins_for([e.pinned for e in chosen], [e.response for e in chosen], c)
        g = s2.group_size
        model.eval()
        group_prompts = [p for p in prompts for _ in range(g)]
        runs = rollout(model, group_prompts, pins.repeat_interleave(g, 0), seed=seed, **s2.sampling)
        rewards = [reward(r.prompt, r.final, references[i // g]) for i, r in enumerate(runs)]
        record: dict = {"step": step + 1}
        record |= reward_stats(rewards)
        record["steps_per_canvas"] = statistics.fmean(r.steps for r in runs)
        record["tokens_per_forward"] = statistics.fmean(r.tokens_per_forward for r in runs)
        model.train()
        loss = torch.zeros((), device=device)
        if s2.distill_weight > 0:
            if s2.distill_target == "teacher":
                targets, teacher_rewards = teacher_targets(
                    reference, prompts, pins, references, reward, s2.target_threshold, seed=seed, **s2.teacher_sampling
                )
                for i in range(len(prompts)):  # the teacher failed: a verified group member instead
                    if targets[i] is None:
                        best = max(range(i * g, (i + 1) * g), key=lambda k: rewards[k])
                        if rewards[best] >= s2.target_threshold:
                            targets[i] = runs[best].final
                per_run = [targets[i // g] for i in range(len(runs))]
                record["teacher_solved"] = sum(w >= s2.target_threshold for w in teacher_rewards) / len(prompts)
            elif s2.distill_target == "reference":  # the record's answer, from every state of every rollout
                per_run = [references[i // g] for i in range(len(runs))]
            else:  # each verified rollout's own end: from every state it visited, predict where it arrived
                per_run = [r.final if w >= s2.target_threshold else None for r, w in zip(runs, rewards, strict=True)]
            distill, used = distillation_loss(
                model,
                runs,
                per_run,
                states_per_trajectory=s2.states_per_trajectory,
                generator=torch.Generator().manual_seed(seed),
            )
            loss = loss + s2.distill_weight * distill
            record["distill_loss"] = float(distill.detach())
            record["distill_states"] = used
        if s2.rl_weight > 0:
            advantages = group_advantages(torch.tensor(rewards), g)
            if bool((advantages != 0).any()):
                canvases = torch.tensor([r.final for r in runs])
                pinned = torch.stack([r.pinned for r in runs])
                corruption = corrupt(canvases, pinned, vocab, torch.Generator().manual_seed(seed + 1))
                with torch.no_grad():
                    ref_logp = token_logprobs(reference, group_prompts, canvases, corruption)
                logp = token_logprobs(model, group_prompts, canvases, corruption)
                # One update per batch of rollouts: the rollout-time policy is the current one, so the
                # ratio starts at 1 (the clip bounds it if more updates per batch are ever made).
                rl, parts = grpo_loss(
                    logp,
                    logp.detach(),
                    ref_logp,
                    advantages.to(device),
                    corruption.scored.to(device),
                    clip=s2.clip,
                    kl_coef=s2.kl_coef,
                )
                loss = loss + s2.rl_weight * rl
                record |= parts
        if loss.requires_grad:
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, o.grad_clip))
        else:  # no verified rollout and no advantage this step: nothing to learn, the schedule moves on
            grad_norm = 0.0
        loss_value = float(loss.detach())
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            raise TrainingDiverged(
                f"step {step + 1}: loss {loss_value}, gradient norm {grad_norm} (try a lower optim.lr)"
            )
        record["lr"] = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        record |= {"loss": loss_value, "grad_norm": grad_norm, "seconds": time.perf_counter() - t0}
        losses.append(loss_value)
        done = step + 1
        if eval_examples and cfg.train.eval_every and done % cfg.train.eval_every == 0:
            record |= evaluate_policy(model, eval_examples, reward, cfg, s2.eval_prompts, cfg.train.seed)
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if bar:
            bar.update(record)
        if done % cfg.train.save_every == 0 or done in (cfg.train.steps, end):
            _save_checkpoint(out_dir, done, model, optimizer, scheduler, cfg, model, tokenizer)
    if bar:
        bar.close()
    if end < cfg.train.steps:
        return TrainResult(out_dir, out_dir / "final", end, losses, None)
    if eval_examples and (not cfg.train.eval_every or cfg.train.steps % cfg.train.eval_every):
        record = {"step": cfg.train.steps, "final": True}
        record |= evaluate_policy(model, eval_examples, reward, cfg, s2.eval_prompts, cfg.train.seed)
        _log("after stage 2: " + ", ".join(f"{k} {v:.3f}" for k, v in record.items() if k not in ("step", "final")))
        with log_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
    final = _export_final(out_dir, cfg, start)
    return TrainResult(out_dir, final, cfg.train.steps, losses, None)


def log_records(out_dir: Path) -> list[dict]:
    """The records of a stage-2 run's log."""
    path = Path(out_dir) / "log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line]
