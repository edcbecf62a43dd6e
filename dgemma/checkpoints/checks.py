"""What every checkpoint reader checks of a file it did not write: sizes in its metadata (read as positive
integers, and compared with the tensors' own shapes before anything is built from them), and the values of
its weights and scales (floating point, finite, positive where the format says so). Each refusal is one
ValueError naming the file, the field or tensor, and what is wrong."""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path

import torch

MAX_SIZE = 2**31 - 1  # a size or count above this describes no model (and would not fit an int32 index)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shown(value: object, limit: int = 60) -> str:
    """`value`'s repr, cut to `limit` characters (an array of a million entries is not printed whole)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_object(path: Path) -> dict:
    """The JSON object a file holds; a ValueError naming the file when it holds something else."""
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON object (got {type(value).__name__})")
    return value


def size_field(value: object, where: str, key: str) -> int:
    """A size or count read from a file's metadata: a positive integer up to MAX_SIZE (not a bool, a list,
    a string or a float); a ValueError naming `where` (the file) and `key` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 < value <= MAX_SIZE:
        raise ValueError(f"{where}: {key} must be a positive integer up to {MAX_SIZE} (got {shown(value)})")
    return int(value)


def number_field(value: object, where: str, key: str) -> float:
    """A real number read from a file's metadata: finite (not a bool, a list or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be a finite number (got {shown(value)})")
    return float(value)


def layer_count(names, prefix: str) -> int:
    """How many layers tensor `names` hold: one more than the largest N of the names `prefix`N.… (0: none)."""
    found = [name[len(prefix) :].partition(".")[0] for name in names if name.startswith(prefix)]
    return max((int(n) + 1 for n in found if n.isdigit()), default=0)


def check_counts(where: str, stated: dict[str, int], found: dict[str, int]) -> None:
    """The sizes a file's metadata states (`stated`, by key) must be those its tensors have (`found`):
    checked before a model of those sizes is built, so an absurd size is refused, not allocated."""
    for key, value in stated.items():
        if key in found and value != found[key]:
            raise ValueError(f"{where}: {key} is {value}, but the file's tensors hold {found[key]}")


def check_shapes(where: str, shapes: dict[str, tuple], expected: dict[str, tuple], optional=frozenset()) -> None:
    """One ValueError naming every tensor of `shapes` (by name, as a file has them) that the model of the
    file's config (`expected`) lacks, that it misses (but `optional`), or whose shape differs."""
    missing = sorted(set(expected) - set(shapes) - set(optional))
    unexpected = sorted(set(shapes) - set(expected))
    common = sorted(set(shapes) & set(expected))
    wrong = [
        f"{n} {tuple(shapes[n])} (config: {tuple(expected[n])})"
        for n in common
        if tuple(shapes[n]) != tuple(expected[n])
    ]
    parts = [
        f"{label} ({len(items)}): {', '.join(items[:8])}{', ...' if len(items) > 8 else ''}"
        for label, items in (("missing tensors", missing), ("unexpected tensors", unexpected), ("wrong shapes", wrong))
        if items
    ]
    if parts:
        raise ValueError(f"{where} does not match its config: " + "; ".join(parts))


def check_values(t: torch.Tensor, where: str, rule: str = "finite") -> torch.Tensor:
    """`t` as read from a file, returned when it is floating point and finite, and for `rule` "positive"
    every value > 0, for "scale" none negative and not all 0; else a ValueError naming `where` (the tensor,
    and its file where known)."""
    if not t.is_floating_point():
        raise ValueError(f"{where} holds {str(t.dtype).removeprefix('torch.')} values, not floating-point ones")
    v = t if t.dtype in _FLOATS else t.float()  # float8: compared as fp32
    if not bool(torch.isfinite(v).all()):
        raise ValueError(f"{where} holds non-finite values (inf or NaN)")
    if rule == "positive" and not bool((v > 0).all()):
        raise ValueError(f"{where} holds {float(v.min())}; it must be > 0")
    if rule == "scale" and bool((v < 0).any()):
        raise ValueError(f"{where} holds negative values ({float(v.min())}); a scale must be >= 0")
    if rule == "scale" and not bool(v.any()):
        raise ValueError(f"{where} is all zeros: every weight it scales would be 0")
    return t
