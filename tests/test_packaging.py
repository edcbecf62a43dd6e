"""The package's metadata says what the code needs: the torch floor covers every torch API dgemma calls
(each listed with the release that added it), numpy is a dependency (torch warns on import without it),
and the license is an SPDX expression (setuptools' table form is deprecated)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import torch
import torch.nn.functional as F

PYPROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())

# torch APIs dgemma depends on (not optional fast paths), and the release that added each
NEEDED = {
    "scaled_dot_product_attention(enable_gqa=)": (2, 5),
    "torch.distributed.fsdp.fully_shard": (2, 6),
    "torch.distributed.fsdp.register_fsdp_forward_method": (2, 6),
}


def _floor(name: str) -> tuple[int, ...]:
    spec = next(d for d in PYPROJECT["project"]["dependencies"] if re.match(rf"{name}\b", d))
    return tuple(int(x) for x in re.search(r">=\s*([\d.]+)", spec).group(1).split("."))


def test_torch_floor_covers_every_api_used():
    assert _floor("torch") >= max(NEEDED.values())
    q, kv = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)  # 4 query heads share 2 key/value heads
    assert F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True).shape == q.shape
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method  # noqa: F401

    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert installed >= _floor("torch")


def test_numpy_is_a_dependency_and_the_license_an_spdx_string():
    assert _floor("numpy") >= (1, 24)
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
