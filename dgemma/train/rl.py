"""Stage 2, part 2: reinforcement learning with verifiable rewards (a GRPO variant for uniform-noise
block diffusion).

Verifiers (`REWARDS`), group-standardised advantages, and the clipped policy-gradient loss with a k3 KL
penalty on a forward-process likelihood estimate (UDM-GRPO). Details: docs/stage2.md, "One step" (3) and
"How the code is laid out".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.model import DiffusionGemma
from .distill import encode_prompts

# ------------------------------------------------------------------------------------------------
# Rewards: (prompt ids, canvas ids, reference canvas ids or None) -> float, built for a tokenizer


def sudoku_reward(tokenizer) -> Callable[[list[int], list[int], list[int] | None], float]:
    """1 when the canvas is a valid grid that keeps every clue of the puzzle in the prompt; otherwise the
    share of rows, columns and boxes that hold nine different digits, times 0.5 (a graded signal that
    never beats a solve)."""
    from ..tasks import sudoku

    def reward(prompt: list[int], canvas: list[int], reference: list[int] | None = None) -> float:
        puzzle = sudoku.decode_grid(tokenizer, prompt[1:82])
        grid = sudoku.decode_grid(tokenizer, canvas[:81])
        if sudoku.is_solution(grid, puzzle):
            return 1.0
        units = sudoku.units_complete(grid)
        kept = all(p in (sudoku.BLANK, g) for p, g in zip(puzzle, grid, strict=True))
        return 0.5 * units if kept else 0.0

    return reward


def match_reward(tokenizer=None) -> Callable[[list[int], list[int], list[int] | None], float]:
    """Code infilling: 1 when the canvas equals the reference completion (the infill matches), otherwise
    the share of reference tokens reproduced in place, times 0.5."""

    def reward(prompt: list[int], canvas: list[int], reference: list[int] | None = None) -> float:
        if reference is None:
            raise ValueError("the match reward needs the record's completion as the reference")
        n = min(len(canvas), len(reference))
        if n == 0:
            return 0.0
        same = sum(a == b for a, b in zip(canvas[:n], reference[:n], strict=True))
        return 1.0 if same == n else 0.5 * same / n

    return reward


REWARDS = {"sudoku": sudoku_reward, "match": match_reward}


# ------------------------------------------------------------------------------------------------
# Advantages and the policy loss


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Rewards [N] (consecutive groups of `group_size`) -> advantages standardised within each group; a
    group whose members all scored the same gets zero advantage (nothing to learn from it)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size).float()
    mean = r.mean(-1, keepdim=True)
    std = r.std(-1, unbiased=False, keepdim=True)
    return ((r - mean) / (std + eps)).masked_fill(std < eps, 0.0).view(-1)


@dataclass
class Corruption:
    """The forward-process corruption a likelihood estimate uses (shared by current, old and reference)."""

    noisy: torch.Tensor  # [N, C]
    scored: torch.Tensor  # [N, C] bool: non-pinned positions


def corrupt(
    canvases: torch.Tensor, pinned: torch.Tensor, vocab_size: int, generator: torch.Generator, eps: float = 1e-4
) -> Corruption:
    """Each canvas's non-pinned positions replaced by uniform random tokens with probability t ~ U(eps, 1-eps)
    (one t per canvas), as in stage 1."""
    n, c = canvases.shape
    t = eps + (1 - 2 * eps) * torch.rand(n, 1, generator=generator)
    flip = (torch.rand(n, c, generator=generator) < t) & ~pinned
    noise = torch.randint(0, vocab_size, (n, c), generator=generator)
    return Corruption(torch.where(flip, noise, canvases), ~pinned)


def token_logprobs(
    model: DiffusionGemma, prompts: list[list[int]], canvases: torch.Tensor, corruption: Corruption
) -> torch.Tensor:
    """log p(o_k | corrupted o, prompt) per canvas position [N, C] (one denoising pass, no
    self-conditioning signal), differentiable when grad is enabled."""
    device = model.device
    cache = encode_prompts(model, prompts, canvases.shape[1])
    logits = model.denoise(corruption.noisy.to(device), cache)
    target = canvases.to(device)
    return -F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none").view(
        target.shape
    )


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    ref_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    scored: torch.Tensor,
    *,
    clip: float = 0.2,
    kl_coef: float = 0.02,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss per token, averaged per canvas then over canvases, plus the k3 KL
    penalty to the reference. logp / old_logp / ref_logp: [N, C]; advantages [N]; scored [N, C] bool."""
    w = scored.float()
    count = w.sum(-1).clamp(min=1)
    ratio = torch.exp(logp - old_logp)
    a = advantages[:, None].to(logp.dtype)
    unclipped = ratio * a
    clipped = ratio.clamp(1 - clip, 1 + clip) * a
    policy = -(torch.minimum(unclipped, clipped) * w).sum(-1) / count
    loss = policy.mean()
    kl_value = 0.0
    if ref_logp is not None and kl_coef > 0:
        r = ref_logp - logp
        kl = ((torch.exp(r) - r - 1) * w).sum(-1) / count
        loss = loss + kl_coef * kl.mean()
        kl_value = float(kl.mean().detach())
    clipped_share = float((((ratio - 1).abs() > clip).float() * w).sum() / w.sum().clamp(min=1))
    return loss, {"policy_loss": float(policy.mean().detach()), "kl": kl_value, "clip_fraction": clipped_share}


def reward_stats(rewards: list[float]) -> dict[str, float]:
    """Mean reward and the share of full-credit answers."""
    n = max(1, len(rewards))
    return {"reward": sum(rewards) / n, "solved": sum(r >= 1.0 for r in rewards) / n}
