"""Traces: how a generation commits its tokens, step by step (what `dgemma analyze` measures and draws).

`trace(model, prompt)` runs a generation and returns a `Trace` holding one `CanvasTrace` per canvas (when each
position was accepted and finalised, its argmax changes, entropy and confidence per step); `canvas_trace`
builds one canvas's record from its step sequence. The fields and what they mean: docs/commitment.md.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .generation.engine import DoneEvent, DraftEvent
from .generation.loop import prompt_rows
from .generation.programs import resolved, stream
from .generation.sampling import SamplingParams
from .runtime.runner import Runner, as_runner


@dataclass
class CanvasTrace:
    """One canvas of one generation (arrays over its C positions, or its steps x C)."""

    index: int  # the canvas's place in the generation (0 first)
    tokens: np.ndarray  # [C] the committed canvas
    content: np.ndarray  # [C] bool: positions returned (not pinned, before the stop and the length limit)
    pinned: np.ndarray  # [C] bool
    first_accepted: np.ndarray  # [C] step of the first acceptance, 1-based (0: never accepted)
    final_step: np.ndarray  # [C] step from which the argmax stayed the committed token, 1-based
    changes: np.ndarray  # [C] argmax changes between consecutive steps
    entropy: np.ndarray  # [steps, C]
    confidence: np.ndarray  # [steps, C]
    accepted: np.ndarray  # [steps, C] bool: accepted (drawn, not renoised) at each step

    @property
    def steps(self) -> int:
        """Denoising steps the canvas ran."""
        return int(self.entropy.shape[0])

    @property
    def accepted_per_step(self) -> np.ndarray:
        """[steps] content positions accepted at each step."""
        return self.accepted[:, self.content].sum(axis=1)

    @property
    def first_accepted_per_step(self) -> np.ndarray:
        """[steps] content positions accepted for the first time at each step."""
        hits = self.first_accepted[self.content]
        return np.bincount(hits[hits > 0], minlength=self.steps + 1)[1:]

    @property
    def finalised_per_step(self) -> np.ndarray:
        """[steps] content positions finalised at each step (the commit batch sizes)."""
        return np.bincount(self.final_step[self.content], minlength=self.steps + 1)[1:]

    @property
    def mean_entropy(self) -> np.ndarray:
        """[steps] mean entropy of the content positions at each step (nan without any)."""
        if not self.content.any():
            return np.full(self.steps, np.nan)
        return self.entropy[:, self.content].mean(axis=1)

    @property
    def commit_confidence(self) -> np.ndarray:
        """[C] each position's confidence at the step it was finalised."""
        return self.confidence[self.final_step - 1, np.arange(self.tokens.shape[0])]


def canvas_trace(
    index: int,
    drafts: np.ndarray,
    accepted: np.ndarray,
    entropy: np.ndarray,
    confidence: np.ndarray,
    pinned: np.ndarray,
    content: np.ndarray,
) -> CanvasTrace:
    """One canvas's record from its step sequence: `drafts`, `accepted`, `entropy`, `confidence` are
    [steps, C] (the argmax canvas and the accepted mask after each step), `pinned` and `content` [C]."""
    drafts = np.asarray(drafts)
    steps, c = drafts.shape
    if steps == 0:
        raise ValueError("a canvas trace needs at least one step")
    final = drafts[-1]
    differs = drafts != final  # [steps, C]: not yet the committed token
    # the last step that still differs, + 1 (+ 1 again for 1-based steps); 1 if none ever differed
    last_differs = np.where(differs.any(0), steps - 1 - np.argmax(differs[::-1], axis=0), -1)
    accepted = np.asarray(accepted, dtype=bool)
    first = np.where(accepted.any(0), np.argmax(accepted, axis=0) + 1, 0)
    return CanvasTrace(
        index=index,
        tokens=final.astype(np.int64),
        content=np.asarray(content, dtype=bool) & ~np.asarray(pinned, dtype=bool),
        pinned=np.asarray(pinned, dtype=bool),
        first_accepted=first.astype(np.int64),
        final_step=(last_differs + 2).astype(np.int64),
        changes=(drafts[1:] != drafts[:-1]).sum(0).astype(np.int64),
        entropy=np.asarray(entropy, dtype=np.float32).reshape(steps, c),
        confidence=np.asarray(confidence, dtype=np.float32).reshape(steps, c),
        accepted=accepted,
    )


@dataclass
class Trace:
    """How one generation committed its tokens: its prompt, what it returned, one record per canvas."""

    prompt: list[int]
    tokens: list[int]  # the returned tokens (stop excluded)
    canvases: list[CanvasTrace]
    max_steps: int  # the step budget of a canvas (SamplingParams.max_denoising_steps)
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # what the caller adds (a task, a reference, ...)

    @property
    def steps(self) -> int:
        return sum(c.steps for c in self.canvases)

    def to_dict(self) -> dict:
        """JSON-ready: arrays as lists."""
        out = {k: v for k, v in asdict(self).items() if k != "canvases"}
        out["canvases"] = [{k: _plain(v) for k, v in asdict(c).items()} for c in self.canvases]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        canvases = [
            CanvasTrace(**{k: v if k == "index" else np.asarray(v) for k, v in c.items()}) for c in d["canvases"]
        ]
        return cls(**{**d, "canvases": canvases})

    def save(self, path: str | Path) -> Path:
        """Write the trace as JSON (`.json`) or as numpy arrays (`.npz`, the JSON header inside)."""
        path = Path(path)
        if path.suffix == ".npz":
            arrays = {f"c{i}.{k}": v for i, c in enumerate(self.canvases) for k, v in asdict(c).items() if k != "index"}
            head = {k: v for k, v in self.to_dict().items() if k != "canvases"} | {"canvases": len(self.canvases)}
            np.savez_compressed(path, header=np.array(json.dumps(head)), **arrays)
        else:
            path.write_text(json.dumps(self.to_dict()))
        return path

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        if path.suffix != ".npz":
            return cls.from_dict(json.loads(path.read_text()))
        with np.load(path) as z:
            head = json.loads(str(z["header"]))
            names = [f.name for f in CanvasTrace.__dataclass_fields__.values() if f.name != "index"]
            canvases = [CanvasTrace(i, **{k: z[f"c{i}.{k}"] for k in names}) for i in range(head.pop("canvases"))]
        return cls(**head, canvases=canvases)


def _plain(v):
    return v.tolist() if isinstance(v, np.ndarray) else v


@torch.no_grad()
def trace(
    model: Runner | Any,
    prompt,
    params: SamplingParams | None = None,
    *,
    tokenizer=None,
    pins: torch.Tensor | None = None,
    **kwargs,
) -> Trace:
    """Generate for one prompt (text with `tokenizer`, or token ids) as `dgemma.generate` does, with the
    same arguments (`pins` for a template, `allowed`, SamplingParams fields, ...), and record how every
    canvas committed its tokens."""
    runner = as_runner(model)
    rows = prompt_rows(prompt, tokenizer)
    if len(rows) != 1:
        raise ValueError("trace takes one prompt")
    c = runner.model.config.canvas_length
    steps: dict[int, list[tuple[np.ndarray, ...]]] = {}
    result = None
    for event in stream(runner, prompt, params, tokenizer=tokenizer, pins=pins, step_stats=True, **kwargs):
        if isinstance(event, DraftEvent):
            row = (event.drafts[0], event.accepted[0], event.entropy[0], event.confidence[0])
            steps.setdefault(event.canvas_index, []).append(tuple(x.cpu().numpy() for x in row))
        elif isinstance(event, DoneEvent):
            result = event.result
    tokens = result.tokens[0]
    canvases = []
    for k, recorded in sorted(steps.items()):
        ran = result.stats.steps_per_canvas[0][k]
        drafts, accepted, entropy, confidence = (np.stack(x) for x in zip(*recorded[:ran], strict=True))
        window = np.full(c, -1) if pins is None else pins[0, k * c : (k + 1) * c].cpu().numpy()
        pinned = np.pad(window >= 0, (0, c - window.shape[0]))
        content = np.arange(c) < len(tokens) - k * c
        canvases.append(canvas_trace(k, drafts, accepted, entropy, confidence, pinned, content))
    settings = {k: v for k, v in kwargs.items() if k in {f.name for f in dataclasses.fields(SamplingParams)}}
    p = resolved(runner.model, params or SamplingParams(), **settings)
    text = None if tokenizer is None else tokenizer.decode(tokens)
    return Trace(rows[0], tokens, canvases, p.max_denoising_steps, text)
