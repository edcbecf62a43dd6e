"""Shared measuring tools of the benchmark scripts."""

from __future__ import annotations

import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemory(TorchDispatchMode):
    """Peak bytes of tensor storage allocated while active and alive at the same time (views and outputs
    that reuse an input's storage add nothing). Independent of the allocator's caching and of the OS."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.refs: dict[int, list[int]] = {}  # storage address -> [tensors alive, bytes]

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors_in}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = t.untyped_storage().data_ptr()
            if key == 0 or (key in inputs and key not in self.refs):
                continue  # a view of (or an in-place result on) memory allocated before we started
            if key in self.refs:
                self.refs[key][0] += 1
            else:
                self.refs[key] = [1, t.untyped_storage().nbytes()]
                self.live += self.refs[key][1]
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, key)
        return out


def matmul_gflops(n: int = 1024, repeats: int = 20, dtype: torch.dtype = torch.float32, rounds: int = 3) -> float:
    """This machine's matmul rate on a large square product in `dtype`: the ceiling for matmul-bound steps.
    The best of `rounds` timings, so that a slow spell of a shared machine does not lower it."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            a @ b
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e9)
    return best


def peak_tensor_mb(fn) -> float:
    """The most tensor memory alive at once while `fn()` runs, in MiB."""
    with TensorMemory() as mem:
        fn()
    return mem.peak / 2**20


def add_glibc_defaults_flag(parser) -> None:
    """`--glibc-defaults`: the baseline of dgemma.runtime.cpu.reuse_freed_memory (see keep_glibc_defaults)."""
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="leave glibc's allocator as it is (a CPU runner otherwise sets it to reuse freed memory)",
    )


def keep_glibc_defaults() -> None:
    """CPU runners made after this leave glibc's allocator as it is (the benchmarks' baseline of
    dgemma.runtime.cpu.reuse_freed_memory, which a runner otherwise applies once per process)."""
    import dgemma.runtime.runner

    dgemma.runtime.runner.reuse_freed_memory = lambda: False


def until_done(request, t0: float) -> tuple[float, float, object]:
    """Read an engine request's events to its end: seconds from `t0` to its first final tokens (its end if
    none came before), to its end, and its result."""
    from dgemma.generation.engine import DoneEvent, TokensEvent

    first = None
    while True:
        event = request.events.get(timeout=3600)
        if isinstance(event, Exception):
            raise event
        if isinstance(event, TokensEvent) and first is None:
            first = time.perf_counter() - t0
        if isinstance(event, DoneEvent):
            end = time.perf_counter() - t0
            return (end if first is None else first), end, event.result


def print_flat(benchmark: str, out: dict) -> None:
    """A flat dict of figures as a two-column table, then the one JSON line the benchmarks end with."""
    import json

    width = max(map(len, out))
    for key, value in out.items():
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    print(json.dumps({"benchmark": benchmark, **out}))
