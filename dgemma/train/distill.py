"""Stage 2, part 1: sampler distillation on the model's own trajectories.

The student is trained, with the stage-1 flat cross-entropy, on the states its own sampler visited
(`rollout`), toward a verified target canvas, so that it becomes confident sooner. What is distilled, why,
and the methods it draws on: docs/stage2.md, "One step" (4) and "How the code is laid out".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..generation.engine import DenoiseCall, DoneEvent, drive
from ..generation.loop import left_pad
from ..generation.programs import Generate
from ..generation.sampling import SamplingParams
from ..model.model import DiffusionGemma
from ..runtime.runner import as_runner


@dataclass
class Trajectory:
    """One row's denoising run: the states its sampler fed to the model, and what it committed."""

    prompt: list[int]
    final: list[int]  # the committed canvas (C tokens)
    pinned: torch.Tensor  # [C] bool
    steps: int  # denoising steps the canvas took
    states: list[torch.Tensor] = field(default_factory=list)  # [C] canvas tokens at each step
    signals: list[torch.Tensor | None] = field(default_factory=list)  # [C, M] self-conditioning input or None

    @property
    def tokens_per_forward(self) -> float:
        """Tokens the canvas produced (pinned ones excluded) per denoising step."""
        return float((~self.pinned).sum()) / max(1, self.steps)


def pins_for(records_pinned: list[list[int] | None], completions: list[list[int]], canvas: int) -> torch.Tensor:
    """The `pins` tensor of dgemma.generate for single-canvas records: the completion's token where the
    record pins a position, -1 elsewhere."""
    pins = torch.full((len(completions), canvas), -1, dtype=torch.long)
    for i, (flags, ids) in enumerate(zip(records_pinned, completions, strict=True)):
        for j, flag in enumerate((flags or [])[:canvas]):
            if flag:
                pins[i, j] = ids[j]
    return pins


@torch.no_grad()
def rollout(
    model: DiffusionGemma,
    prompts: list[list[int]],
    pins: torch.Tensor,
    *,
    record: bool = True,
    seed: int = 0,
    **sampling,
) -> list[Trajectory]:
    """Run the model's sampler on one canvas per prompt (fast mode, pinned positions kept) and record, per
    row, every state the model was given. `sampling`: SamplingParams fields (max_denoising_steps,
    entropy_bound, sampler, ...)."""
    c = model.config.canvas_length
    runner = as_runner(model)
    params = SamplingParams(max_new_tokens=c, stop_token_ids=[], seed=seed, **sampling)
    loop = Generate(prompts, params, pins=pins).check(runner.model).program(runner.model, runner.canvas_stats)
    b = len(prompts)
    states: list[list[torch.Tensor]] = [[] for _ in range(b)]
    signals: list[list[torch.Tensor | None]] = [[] for _ in range(b)]

    def record_states(call: DenoiseCall) -> None:
        rows = range(b) if call.cache.row_index is None else call.cache.row_index.tolist()
        sc = call.self_conditioning
        for k, r in enumerate(rows):
            states[r].append(call.tokens[k].cpu())
            signals[r].append(None if sc is None else sc[k].cpu())

    result = None
    for event in drive(model, loop, record_states if record else None):
        if isinstance(event, DoneEvent):
            result = event.result
    assert result is not None, "the canvas loop ended without a result"
    out = []
    for i in range(b):
        final = result.sequences[i, :c].tolist()
        steps = result.stats.steps_per_canvas[i][0] if result.stats.steps_per_canvas[i] else 0
        out.append(Trajectory(prompts[i], final, pins[i] >= 0, steps, states[i], signals[i]))
    return out


@torch.no_grad()
def encode_prompts(model: DiffusionGemma, prompts: list[list[int]], canvas: int):
    """A KV cache holding the left-padded prompts (no gradients), with room for one canvas."""
    pad = model.text_config.pad_token_id or 0
    ids, mask = left_pad(prompts, pad, model.device)
    cache = model.new_cache(len(prompts), ids.shape[1] + canvas)
    model.encode(ids, cache, attention_mask=mask)
    return cache


def distillation_loss(
    model: DiffusionGemma,
    trajectories: list[Trajectory],
    targets: list[list[int] | None],
    *,
    states_per_trajectory: int = 4,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, int]:
    """Mean cross-entropy of the model, at states drawn from the trajectories (with their recorded
    self-conditioning signals), against the target canvases; rows without a target are skipped. Returns
    (loss, number of states used)."""
    items = []
    for traj, target in zip(trajectories, targets, strict=True):
        if target is None or not traj.states:
            continue
        n = len(traj.states)
        picks = torch.randperm(n, generator=generator)[: min(states_per_trajectory, n)].tolist()
        for s in picks:
            items.append((traj, target, s))
    if not items:
        return torch.zeros((), device=model.device, requires_grad=True), 0
    device = model.device
    c = model.config.canvas_length
    cache = encode_prompts(model, [t.prompt for t, _, _ in items], c)
    canvas = torch.stack([t.states[s] for t, _, s in items]).to(device)
    signals = [t.signals[s] for t, _, s in items]  # None at a trajectory's first step: no signal yet
    soft = None
    if any(x is not None for x in signals):
        zero = torch.zeros(c, model.text_config.hidden_size, dtype=model.dtype)
        soft = torch.stack([zero if x is None else x for x in signals]).to(device)
    logits = model.denoise(canvas, cache, soft)
    target = torch.tensor([tg for _, tg, _ in items], device=device)
    scored = ~torch.stack([t.pinned for t, _, _ in items]).to(device)
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
    per_token = per_token.view(target.shape)
    per_state = (per_token * scored).sum(-1) / scored.sum(-1).clamp(min=1)
    return per_state.mean(), len(items)


def teacher_targets(
    teacher: DiffusionGemma,
    prompts: list[list[int]],
    pins: torch.Tensor,
    references: list[list[int] | None],
    reward: Callable[[list[int], list[int], list[int] | None], float],
    threshold: float,
    *,
    seed: int = 0,
    **teacher_sampling,
) -> tuple[list[list[int] | None], list[float]]:
    """The teacher's committed canvases where `reward(prompt, canvas, reference) >= threshold` (None
    elsewhere), and the teacher's rewards."""
    runs = rollout(teacher, prompts, pins, record=False, seed=seed, **teacher_sampling)
    rewards = [reward(r.prompt, r.final, ref) for r, ref in zip(runs, references, strict=True)]
    return [r.final if w >= threshold else None for r, w in zip(runs, rewards, strict=True)], rewards
