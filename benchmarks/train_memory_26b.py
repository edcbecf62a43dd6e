"""Peak memory of one LoRA training step of the real 26B-A4B model over a quantized frozen base, on CPU.

Builds the `26b-a4b` configuration (25.25B parameters, 30 layers, 128 experts) directly in its quantized
form with random codes (benchmarks/memory_26b.py's direct build: nothing is ever in bf16 first), wraps it
with LoRA rank 8 as recipes/sudoku-lora-26b-24gb.yaml does (adapters in bf16 unless --adapter-dtype),
and runs one optimizer step at batch 1 as the trainer runs it: block_diffusion_loss (encoder pass with
gradients, pass 1 without, pass 2 with self-conditioning; the logits a chunk of 64 tokens at a time),
gradient checkpointing of every layer (the encoder's too), backward, AdamW over the adapters only. Variants:

- `attn+mlp`: LoRA on the attention projections and the dense MLP (the experts frozen, as Unsloth and
  NeMo train);
- `experts`: also the 128 experts, one pair of factors per expert (lora.experts: per_expert);
- `experts-shared`: also the experts, one pair of factors shared by all of them.

Each (variant, prompt length) runs in a fresh process, so each peak is its own. Two peaks are reported:
- allocated: the bytes glibc's malloc has handed out and not taken back (mallinfo2: arena chunks in use
  plus mmapped blocks; the child runs with one arena, MALLOC_ARENA_MAX=1, so that this sees every
  thread's), which is tensor bytes plus the interpreter's objects, sampled every 10 ms (a transient
  shorter than that can be missed);
- RSS: the process's peak resident memory (getrusage, exact), which also counts freed memory the
  allocator keeps, and the libraries.

A GPU holds the same tensors, so "allocated" is the figure to compare with a card's memory (plus the
CUDA context, ~0.5 GB). Random weights: the numbers are about memory and time, not learning.

    python benchmarks/train_memory_26b.py [--quant nvfp4] [--variants attn+mlp experts experts-shared]
        [--prompts 256 1024] [--canvas 256] [--layers 30] [--adapter-dtype bfloat16] [--threads N]

Needs ~20 GB of free memory and, on 2 CPU cores, tens of minutes per run. Prints a table and ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_26b import build_direct, config_with_layers, peak_rss_bytes

GIB = 2**30
VARIANTS = {
    "attn+mlp": (["attention", "mlp"], "per_expert"),
    "experts": (["attention", "mlp", "experts"], "per_expert"),
    "experts-shared": (["attention", "mlp", "experts"], "shared"),
}
# glibc malloc settings of the measured process: one arena, so that mallinfo2 (which reports the main arena
# and the mmapped blocks) sees every allocation, the intra-op threads' too; and a fixed mmap threshold of
# 1 MiB, so that freed tensors go back to the system at once. With glibc's default (a threshold that
# rises to 32 MiB as large blocks are freed) the freed expert and logit temporaries stay in the heap,
# fragmented: the attn+mlp run's RSS reached 24 GiB (killed) with 18 GiB allocated.
MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
ANCHORS = [
    ("Unsloth, LoRA (experts frozen, bf16)", ">= 50 GB on one GPU"),
    ("NeMo AutoModel, LoRA", "8 x H100 (80 GB) node"),
]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2


def allocated_bytes() -> int:
    """Bytes malloc has handed out and not taken back: in-use arena chunks plus mmapped blocks."""
    info = _LIBC.mallinfo2()
    return info.uordblks + info.hblkhd


class PeakSampler:
    """The peak of allocated_bytes() per phase, sampled every `interval` seconds on a thread."""

    def __init__(self, interval: float = 0.01):
        self.interval, self.phases, self._peak = interval, {}, allocated_bytes()
        self._start, self._done = time.perf_counter(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self._peak = max(self._peak, allocated_bytes())

    def lap(self, name: str) -> None:
        now, current = time.perf_counter(), allocated_bytes()
        self.phases[name] = {
            "seconds": round(now - self._start, 1),
            "peak_allocated_gib": max(self._peak, current) / GIB,
            "peak_rss_gib_so_far": peak_rss_bytes() / GIB,
        }
        self._peak, self._start = current, time.perf_counter()

    def stop(self) -> dict:
        self._done.set()
        self._thread.join()
        return self.phases


def one_step(model, prompt: int, canvas: int) -> float:
    """One optimizer step at batch 1 (prompt + one canvas of random tokens), as the trainer runs it."""
    from dgemma.train.data import Example
    from dgemma.train.objective import ObjectiveConfig, assemble, block_diffusion_loss, draw_sample

    cfg = ObjectiveConfig(logit_chunk_tokens=64)
    vocab = model.text_config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, min(vocab, 200_000), (prompt + canvas,), generator=g).tolist()  # no special tokens
    example = Example(ids[:prompt], ids[prompt:])
    batch = assemble([draw_sample(example, 0, 0, canvas, vocab, cfg)], canvas, eos_id=1, pad_id=0)
    loss, _ = block_diffusion_loss(model, batch, cfg)
    loss.backward()
    return float(loss)


def run_one(args: argparse.Namespace) -> dict:
    """One (variant, prompt) measurement in this process."""
    from dgemma.train.lora import apply_lora

    torch.set_num_threads(args.threads)
    targets, experts = VARIANTS[args.one]
    sampler = PeakSampler()
    config = config_with_layers(args.layers)
    config.canvas_length = args.canvas
    model, n_params = build_direct(config, args.quant, args.group_size)
    model.train()
    model.gradient_checkpointing = True
    weight_bytes = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    sampler.lap("build")
    peft_model = apply_lora(
        model, r=8, alpha=16, targets=targets, experts=experts, dtype=getattr(torch, args.adapter_dtype)
    )
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1.5e-4, betas=(0.95, 0.99), eps=1e-8, weight_decay=1e-4)
    sampler.lap("lora")
    loss = one_step(peft_model, args.prompt, args.canvas)
    sampler.lap("forward + backward")
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sampler.lap("optimizer step")
    phases = sampler.stop()
    return {
        "variant": args.one,
        "quant": args.quant,
        "layers": config.text_config.num_hidden_layers,
        "prompt": args.prompt,
        "canvas": args.canvas,
        "parameters": n_params,
        "weights_gib": weight_bytes / GIB,
        "adapter_parameters": sum(p.numel() for p in trainable),
        "adapter_dtype": str(trainable[0].dtype).removeprefix("torch."),
        "loss": loss,
        "peak_allocated_gib": max(p["peak_allocated_gib"] for p in phases.values()),
        "peak_rss_gib": peak_rss_bytes() / GIB,
        "phases": phases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="nvfp4", choices=["nvfp4", "int4", "fp8", "int8"])
    ap.add_argument("--group-size", type=int, default=64, help="int4's inputs per scale")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--prompts", nargs="+", type=int, default=[256, 1024], help="prompt lengths (default 256 1024)")
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--adapter-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--layers", type=int, default=None, help="full-size layers (default: the model's 30)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)  # a child process's measurement
    ap.add_argument("--prompt", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args)))
        return
    rows = []
    for prompt in args.prompts:
        for variant in args.variants if prompt == args.prompts[0] else args.variants[:2]:
            cmd = [sys.executable, __file__, "--one", variant, "--prompt", str(prompt), "--quant", args.quant]
            cmd += ["--group-size", str(args.group_size), "--canvas", str(args.canvas), "--threads", str(args.threads)]
            cmd += ["--adapter-dtype", args.adapter_dtype]
            cmd += ["--layers", str(args.layers)] if args.layers else []
            t = time.perf_counter()
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **MALLOC_ENV})
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{variant} at prompt {prompt} failed (exit {out.returncode})")
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{variant} prompt {prompt}: {rows[-1]} ({time.perf_counter() - t:.0f} s)", file=sys.stderr)
    print_table(rows, args)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"| LoRA rank 8 over {args.quant} | prompt + canvas | adapter params | peak allocated | peak RSS | step |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        seconds = sum(p["seconds"] for k, p in r["phases"].items() if k != "build")
        print(
            f"| {r['variant']} ({r['layers']} layers) | {r['prompt']} + {r['canvas']} | "
            f"{r['adapter_parameters'] / 1e6:.1f}M {r['adapter_dtype']} | {r['peak_allocated_gib']:.2f} GiB | "
            f"{r['peak_rss_gib']:.2f} GiB | {seconds:.0f} s |"
        )
    for name, need in ANCHORS:
        print(f"| {name} | - | - | {need} | - | - |")
    ok = all(r["peak_rss_gib"] <= 22 for r in rows if r["prompt"] == 256)
    print(json.dumps({"benchmark": "train_memory_26b", "goal_22gib_at_256": ok, "rows": rows}))


if __name__ == "__main__":
    main()
