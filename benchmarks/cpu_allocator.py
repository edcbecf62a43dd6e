"""What `dgemma.runtime.cpu.reuse_freed_memory` (glibc's mmap and trim thresholds, set by a CPU runner) is worth:
a process's first generation and a steady loop of denoising steps on the `small` preset (random weights,
canvas 256), each in a fresh process with the setting and with glibc's defaults, page faults counted
(ru_minflt). Fresh processes, because glibc's own thresholds move with a process's history: once a
large mapped block has been freed they rise by themselves, so a later generation gains little.

Prints a table and ends with one JSON line. Run: python benchmarks/cpu_allocator.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# One case in a fresh process: prints "seconds faults" of what it measures.
CASE = """
import resource, statistics, sys, time, torch
import dgemma
from _measure import keep_glibc_defaults
from dgemma.model.presets import preset
case, allocator = sys.argv[1], sys.argv[2]
if allocator == "glibc":
    keep_glibc_defaults()
torch.set_num_threads(2)
config = preset("small")
config.canvas_length = 256
model = dgemma.build(config).eval()
runner = dgemma.accelerate(model)
prompt = torch.randint(3, 32768, (64,), generator=torch.Generator().manual_seed(0)).tolist()

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

if case == "first generation":  # 2 canvases of 8 steps: prefill, 16 steps, 2 commits
    f0, t0 = faults(), time.perf_counter()
    dgemma.generate(runner, prompt, mode="fast", seed=0, stop_token_ids=[], max_new_tokens=512, max_denoising_steps=8,
                    confidence_threshold=1e-30)
    print(time.perf_counter() - t0, faults() - f0)
else:  # one denoising step at a time, its logits into one buffer, as the canvas loop runs it
    cache = model.new_cache(1, 64 + 256)
    with torch.no_grad():
        model.encode(torch.tensor([prompt]), cache)
        canvas, out = torch.randint(3, 32768, (1, 256)), torch.empty(1, 256, 32768)
        for _ in range(2):
            runner.denoise(canvas, cache, out=out)
        times, f0 = [], faults()
        for _ in range(5):
            t0 = time.perf_counter()
            runner.denoise(canvas, cache, out=out)
            times.append(time.perf_counter() - t0)
    print(statistics.median(times), (faults() - f0) / 5)
"""

CASES = ("first generation", "denoising step")
ALLOCATORS = ("glibc", "reuse")


def run_case(case: str, allocator: str) -> tuple[float, float]:
    here = str(Path(__file__).resolve().parent)  # for _measure
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", CASE, case, allocator]
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    seconds, faults = out.stdout.split()[-2:]
    return float(seconds), float(faults)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per case and allocator")
    args = parser.parse_args()
    samples = {(c, a): [] for c in CASES for a in ALLOCATORS}
    for _ in range(args.rounds):  # alternating, so that a slow spell of a shared machine hits both alike
        for key in samples:
            samples[key].append(run_case(*key))
    print(f"{'case':18s} {'allocator':28s} {'seconds':>9s} {'page faults':>12s}")
    results = []
    for (case, allocator), runs in samples.items():
        seconds = statistics.median(s for s, _ in runs)
        faults = statistics.median(f for _, f in runs)
        label = "glibc's defaults" if allocator == "glibc" else "reuse_freed_memory (default)"
        print(f"{case:18s} {label:28s} {seconds:9.3f} {faults:12.0f}")
        results.append({"case": case, "allocator": allocator, "seconds": seconds, "page_faults": faults})
    for case in CASES:
        glibc, reuse = (statistics.median(s for s, _ in samples[case, a]) for a in ALLOCATORS)
        print(f"{case}: {glibc / reuse:.2f}x faster with the setting")
    print(json.dumps({"benchmark": "cpu_allocator", "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()
