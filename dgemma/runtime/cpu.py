"""What this CPU multiplies in, and the compute a fast step uses on it by default.

A CPU with native bf16 products (AMX-BF16, AVX512-BF16) multiplies bf16 at several times its fp32 rate,
and one with int8 dot products (AMX-INT8, AVX512-VNNI, AVX-VNNI) int8 faster still; torch dispatches to
them through oneDNN. The flags are read from /proc/cpuinfo (none where it is not readable: then nothing
is assumed). `dgemma bench` reports them; `preferred_dtype` and `int8_matmuls` are the defaults that
follow from them (measured side by side in BENCHMARKS.md, "bf16 and int8 compute on CPU").

`reuse_freed_memory` is the allocator setting a CPU step needs: without it glibc hands the megabytes a
step frees back to the kernel and faults them in again on the next step. `release_freed_memory` is its
counterpart for a burst that will not repeat (the server's image decodes): everything freed goes back now.
"""

from __future__ import annotations

import ctypes
import os
import platform
from functools import cache
from pathlib import Path

import torch

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "avx_ne_convert")  # /proc/cpuinfo flags of bf16 products
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # and of int8 dot products

# glibc's mallopt parameters (malloc.h) and the values reuse_freed_memory sets.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: blocks under 32 MB come from the heap, not fresh mappings
TRIM_THRESHOLD = 128 * 2**20  # free memory kept at the heap's top for the next step, at most
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The feature flags of `cpuinfo` (default: /proc/cpuinfo, read once; empty where it is unreadable)."""
    if cpuinfo is None:
        return _proc_flags()
    line = next((x for x in cpuinfo.splitlines() if x.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


@cache
def _proc_flags() -> frozenset[str]:
    try:
        return cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def free_cpus() -> int:
    """The CPU cores this process may use that other processes are not busy on: its cores less the
    one-minute load average, at least 1 (a server's torch threads beside another busy process would
    oversubscribe the cores: every step waits on the slowest thread)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        busy = round(os.getloadavg()[0])
    except OSError:
        busy = 0
    return max(1, cores - busy)


def cpu_features(cpuinfo: str | None = None) -> dict:
    """What this CPU multiplies in: the vector width torch dispatches to, and its bf16 and int8
    instructions (read from `cpuinfo`, default /proc/cpuinfo; none where that is not readable)."""
    flags = cpu_flags(cpuinfo)
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "bf16": [f for f in BF16_FLAGS if f in flags],
        "int8": [f for f in INT8_FLAGS if f in flags],
    }


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has bf16 matmul instructions (AMX-BF16 or AVX512-BF16)."""
    return bool({"amx_bf16", "avx512_bf16"} & cpu_flags(cpuinfo))


def int8_matmuls(cpuinfo: str | None = None) -> bool:
    """Whether this CPU has int8 dot products (AMX-INT8, AVX512-VNNI or AVX-VNNI): where it does, the fast
    twin runs int8-quantized linears as W8A8 integer matmuls (torch._int_mm) instead of dequantizing."""
    return bool(set(INT8_FLAGS) & cpu_flags(cpuinfo))


def preferred_dtype(device: torch.device | str, cpuinfo: str | None = None) -> torch.dtype:
    """The compute dtype for weights made here at random (`dgemma bench --preset`): bf16 on a GPU and on a
    CPU with bf16 matmuls, fp32 on other CPUs."""
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if native_bf16(cpuinfo) else torch.float32


def on_glibc() -> bool:
    """Whether this process runs on Linux's glibc (whose allocator reuse_freed_memory tunes)."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@cache
def _libc():
    """glibc's C library (None off glibc or where it cannot be loaded)."""
    if not on_glibc():
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@cache
def reuse_freed_memory() -> bool:
    """Keep the memory a step frees for the next one (glibc only; once per process): returns whether set.

    glibc serves blocks of 128 KB and more from fresh mappings and returns freed memory at the heap's top
    to the kernel (raising both thresholds by itself only once a large mapped block is freed), so until
    then every step of a model's size faults its temporaries in again page by page: 16k page faults per
    `small` denoising step, whose steady step is then 1.54x slower and a process's first generation
    1.28x (benchmarks/cpu_allocator.py). This sets glibc's mmap threshold to 32 MB (its largest) and its
    trim threshold to 128 MB: a process keeps at most that much freed memory at the heap's top. Left
    alone where the user tunes malloc already (GLIBC_TUNABLES, MALLOC_*_ variables) and off glibc
    (another allocator, or none of these settings)."""
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(v in os.environ for v in MALLOC_ENV):
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1


def release_freed_memory() -> bool:
    """Hand the free pages of the malloc arenas back to the kernel now (glibc's malloc_trim(0)); returns
    whether any was released (False off glibc).

    glibc returns only the free memory at the top of a heap, and only past the trim threshold (128 MB
    once reuse_freed_memory has run); each thread that allocates gets an arena of its own, and blocks
    under the mmap threshold (32 MB then) come from them. So after a burst of large temporaries on worker
    threads (decoded images: Pillow allocates them in 16 MB blocks) the freed blocks stay resident and RSS
    stays at its peak; this gives back every whole free page inside them. Not the free top of a worker
    thread's arena: glibc 2.36's malloc_trim leaves that alone, and under the raised trim threshold frees
    do not shrink it either. It takes tens of ms (a few GB of free heap), so call it after a burst, not
    per allocation."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return trim(0) == 1
