"""The sampling settings, defined once: `SamplingParams`, whose every field carries its help, its finite
range (or its choices) and its default, and `validate`, the one rule set that the library, the command
line, the server and `generation_config.json` all go through.

Everything else is generated from these fields or checked against them: the server's request fields
(dgemma/server/protocol.py reads `setting_field`), `GenerationConfig`'s checks (dgemma/config.py), and
tests that the CLI's flags and the training recipes' `sampling` sections name these fields. A new
setting is added here, once.

Ranges are finite. The bounds that size buffers are the ones that matter (`stability_threshold` sizes a
[threshold, B, C] history; steps and lengths size loops and caches); the others keep values meaningful
(a per-position entropy is at most log V, ~12.5 for a 262k vocabulary).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

MODES = ("fast", "exact")
SAMPLER_NAMES = ("entropy-bound", "confidence", "fixed")  # dgemma.sampling.SAMPLERS' keys (tested)
# the settings a checkpoint's generation_config.json supplies when a call leaves them None
CHECKPOINT_DEFAULTED = (
    "max_new_tokens",
    "max_denoising_steps",
    "entropy_bound",
    "t_min",
    "t_max",
    "stability_threshold",
    "confidence_threshold",
)


def _setting(default: Any, help: str, *, low=None, high=None, open_low=False, choices=None, kind=None):
    """A SamplingParams field with its metadata: help, range (low, high; low excluded when open_low) or
    choices, and its kind (int, float, str, bool)."""
    metadata = {"help": help, "low": low, "high": high, "open_low": open_low, "choices": choices, "kind": kind}
    return field(default=default, metadata=metadata)


@dataclass
class SamplingParams:
    """How to generate. Fields left None take the checkpoint's generation_config.json (or the reference
    defaults: 48 steps, entropy bound 0.1, temperature 0.8 -> 0.4, stop when stable for 1 step and mean
    entropy < 0.005, 256 new tokens)."""

    max_new_tokens: int | None = _setting(None, "tokens to generate, exactly", low=1, high=2**20, kind=int)
    max_denoising_steps: int | None = _setting(None, "most denoising steps per canvas", low=1, high=1024, kind=int)
    entropy_bound: float | None = _setting(
        None,
        "entropy-bound sampler: accept positions, lowest entropy first, while their entropies sum below this",
        low=0.0,
        high=1e4,
        open_low=True,
        kind=float,
    )
    t_min: float | None = _setting(
        None, "temperature on a canvas's last step", low=0.0, high=10.0, open_low=True, kind=float
    )
    t_max: float | None = _setting(
        None, "temperature on a canvas's first step", low=0.0, high=10.0, open_low=True, kind=float
    )
    stability_threshold: int | None = _setting(
        None, "stop rule: the draft unchanged for this many steps", low=0, high=1024, kind=int
    )
    confidence_threshold: float | None = _setting(
        None, "stop rule: ... and its mean entropy below this", low=0.0, high=100.0, open_low=True, kind=float
    )
    stop_token_ids: list[int] | None = None  # default: the generation config's eos_token_id
    sampler: str = _setting("entropy-bound", "which positions a step accepts", choices=SAMPLER_NAMES, kind=str)
    confidence: float = _setting(
        0.9, "confidence sampler: accept positions with p(top) at least this", low=0.0, high=1.0, open_low=True,
        kind=float,
    )  # fmt: skip
    tokens_per_step: int = _setting(16, "fixed sampler: positions accepted per step", low=1, high=4096, kind=int)
    mode: str = _setting(
        "fast", "fast: same distribution, less work; exact: transformers' token ids", choices=MODES, kind=str
    )
    seed: int | None = _setting(None, "random seed (None: a fresh one)", low=0, high=2**63 - 1, kind=int)
    greedy: bool = _setting(
        False, "accepted positions take their most likely token, not a draw (what temperature 0 asks)", kind=bool
    )
    early_commit: bool = _setting(False, "stream and freeze a canvas's leading tokens once they settle", kind=bool)
    early_commit_steps: int = _setting(
        3, "early commit: after this many steps with the same argmax", low=1, high=1024, kind=int
    )
    early_commit_entropy: float = _setting(
        0.1, "early commit: ... and an entropy below this at each", low=0.0, high=100.0, open_low=True, kind=float
    )

    def resolve(self, defaults, eos_fallback: list[int]) -> SamplingParams:
        """A copy with every None filled in from `defaults` (a GenerationConfig), validated (a ValueError
        names what is wrong)."""
        p = dataclasses.replace(self)
        for name in CHECKPOINT_DEFAULTED:
            if getattr(p, name) is None:
                setattr(p, name, getattr(defaults, name))
        if p.stop_token_ids is None:
            eos = defaults.eos_token_id
            p.stop_token_ids = eos_fallback if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        errors = validate(dataclasses.asdict(p))
        if p.mode == "exact" and (p.sampler != "entropy-bound" or p.early_commit or p.greedy):
            errors.append(
                "mode 'exact' reproduces transformers' generate: it has the entropy-bound sampler only, "
                "no early commit and no greedy draws"
            )
        if errors:
            raise ValueError("invalid sampling parameters: " + "; ".join(errors))
        return p

    def make_sampler(self):
        """The acceptance rule these settings name (see dgemma.sampling)."""
        from .sampling import SAMPLERS

        if self.sampler == "entropy-bound":
            return SAMPLERS[self.sampler](self.entropy_bound)
        if self.sampler == "confidence":
            return SAMPLERS[self.sampler](self.confidence)
        return SAMPLERS[self.sampler](self.tokens_per_step)


# name -> metadata (help, low, high, open_low, choices, kind) of every setting
SETTINGS: dict[str, dict[str, Any]] = {
    f.name: dict(f.metadata) for f in dataclasses.fields(SamplingParams) if f.metadata
}


def check(name: str, value: Any) -> str | None:
    """Why `value` is not a valid value of the setting `name`, or None (None itself is valid: 'default')."""
    meta = SETTINGS[name]
    if value is None:
        return None
    kind = meta["kind"]
    if meta["choices"] is not None:
        return None if value in meta["choices"] else f"{name} must be one of {meta['choices']} (got {value!r})"
    if kind is bool:
        return None if isinstance(value, bool) else f"{name} must be true or false (got {value!r})"
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int and not (number and float(value).is_integer()):
        return f"{name} must be an integer (got {value!r})"
    if not number or not math.isfinite(value):
        return f"{name} must be a finite number (got {value!r})"
    low, high, open_low = meta["low"], meta["high"], meta["open_low"]
    if value < low or value > high or (open_low and value == low):
        shown = f"{low}, {high}" if kind is int else f"{low:g}, {high:g}"
        what = "an integer" if kind is int else "a number"
        return f"{name} must be {what} in {'(' if open_low else '['}{shown}] (got {value!r})"
    return None


def validate(values: dict[str, Any]) -> list[str]:
    """Every problem with these settings (any subset of SamplingParams' fields), as messages naming them;
    GenerationConfig checks its own values with this too."""
    errors = [e for name, v in values.items() if name in SETTINGS and (e := check(name, v))]
    t_min, t_max = values.get("t_min"), values.get("t_max")
    if not errors and t_min is not None and t_max is not None and not t_min < t_max:
        errors.append(f"need t_min < t_max (got t_min={t_min}, t_max={t_max})")
    return errors
