"""An evaluation harness nobody here wrote, against `dgemma serve`: lm-eval's `local-completions` model on a
local multiple-choice task, and the same accuracy computed directly from dgemma's Python API.

The task (benchmarks/lm_eval/dgemma_code_next_line.yaml, its data in code_next_line.jsonl, made by
`--make-task` from the held-out split of the Python standard library the shipped code model was not
trained on): given eight lines of a file, which of four lines comes next (the true one and three others
from the same file). lm-eval tokenizes each (context, choice) with the model's tokenizer (Hugging Face
backend), sends the ids with `echo: true, logprobs: 1, max_tokens: 1` to /v1/completions, and sums the
returned prompt log-probabilities of the choice's tokens (the causal encoder's, dgemma/server/logprobs.py).
The direct computation splits the texts by lm-eval's rule (trailing whitespace of the context moves to
the choice, the choice's tokens are those of context + choice after the context's) and sums
`dgemma.generation.editing.prompt_logprobs` over them.

    .venv/bin/pip install 'lm-eval[api]==0.4.13'
    python benchmarks/lm_eval_mc.py [--model DIR] [--limit N] [--make-task]

Prints a table (accuracy both ways, how many answers agree) and ends with one JSON line. Needs lm-eval
(not a dependency of dgemma: its `datasets` stack is large); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
TASK_DIR = HERE / "lm_eval"
DATA = TASK_DIR / "code_next_line.jsonl"
TASK = "dgemma_code_next_line"


def make_task(n: int = 100, seed: int = 0) -> None:
    """Write the task's items from held-out standard-library files: 8 lines of context, 4 candidate next
    lines (lines of at least 12 characters, distinct, from the same file), the true one's index."""
    from dgemma.tasks.code import collect

    rng = random.Random(seed)
    files = [f for f in collect() if f.split == "test"]
    items = []
    while len(items) < n:
        lines = rng.choice(files).text.splitlines()
        good = [i for i, line in enumerate(lines) if i >= 8 and len(line.strip()) >= 12]
        if len(good) < 8:
            continue
        i = rng.choice(good)
        others = list({lines[j] for j in good if lines[j] != lines[i]})
        if len(others) < 3:
            continue
        choices = [lines[i], *rng.sample(sorted(others), 3)]
        rng.shuffle(choices)
        context = "\n".join(lines[i - 8 : i]) + "\n"
        items.append({"context": context, "choices": choices, "gold": choices.index(lines[i])})
    DATA.write_text("".join(json.dumps(item) + "\n" for item in items))
    print(f"wrote {len(items)} items to {DATA}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dgemma.cli", "serve", "-m", model, "--port", str(port), "--log-level", "warning"]
    cmd += ["--served-model-name", "dgemma"]
    proc = subprocess.Popen(cmd)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("dgemma serve exited")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("dgemma serve did not start")


def run_lm_eval(model: str, port: int, limit: int | None, out: Path) -> tuple[float, list[int]]:
    """lm-eval's accuracy and its per-item predictions (the index of the highest log-likelihood)."""
    args = ",".join(
        [
            "model=dgemma",
            f"base_url=http://127.0.0.1:{port}/v1/completions",
            f"tokenizer={model}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            "max_retries=1",
        ]
    )
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args]
    cmd += ["--tasks", TASK, "--include_path", str(TASK_DIR), "--output_path", str(out), "--log_samples"]
    cmd += ["--batch_size", "8"]
    cmd += [] if limit is None else ["--limit", str(limit)]
    subprocess.run(cmd, check=True, cwd=HERE.parent, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][TASK]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{TASK}_*.jsonl")).read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    preds = [max(range(len(s["filtered_resps"])), key=lambda i: float(s["filtered_resps"][i][0])) for s in samples]
    return results["acc,none"], preds


def direct(model: str, limit: int | None) -> tuple[float, list[int]]:
    """The same accuracy from dgemma's Python API: encoder log-probabilities of each choice's tokens."""
    import dgemma
    from dgemma.generation.programs import prompt_logprobs

    m, tok = dgemma.load(model, dtype="fp32"), dgemma.Tokenizer.from_dir(model)
    items = [json.loads(line) for line in DATA.read_text().splitlines()][:limit]
    preds = []
    for item in items:
        scores = []
        for choice in item["choices"]:
            context = item["context"]
            spaces = len(context) - len(context.rstrip())  # lm-eval moves them to the continuation
            context, choice = context[: len(context) - spaces], context[len(context) - spaces :] + choice
            whole = tok.encode(context + choice, add_special_tokens=False)
            n = len(tok.encode(context, add_special_tokens=False))
            chosen, _ = prompt_logprobs(m, whole, 0)
            scores.append(sum(chosen[n:]))
        preds.append(max(range(len(scores)), key=scores.__getitem__))
    acc = sum(p == item["gold"] for p, item in zip(preds, items, strict=True)) / len(items)
    return acc, preds


def main() -> None:
    from dgemma.tasks.code import MODEL_DIR

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(MODEL_DIR))
    ap.add_argument("--limit", type=int, default=None, help="items (default all 100)")
    ap.add_argument("--make-task", action="store_true", help="write the task's data again (seed 0)")
    args = ap.parse_args()
    if args.make_task:
        make_task()
    port = _free_port()
    server = _serve(args.model, port)
    try:
        with tempfile.TemporaryDirectory() as out:
            t0 = time.perf_counter()
            harness_acc, harness = run_lm_eval(args.model, port, args.limit, Path(out))
            seconds = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=30)
    direct_acc, mine = direct(args.model, args.limit)
    agree = sum(a == b for a, b in zip(harness, mine, strict=True))
    print(f"{'':24}{'accuracy':>10}")
    print(f"{'lm-eval (dgemma serve)':24}{harness_acc:>10.3f}")
    print(f"{'dgemma Python API':24}{direct_acc:>10.3f}")
    print(f"items {len(mine)}, the same answer on {agree}, chance 0.25, lm-eval ran {seconds:.0f} s")
    row = {"items": len(mine), "lm_eval_acc": harness_acc, "direct_acc": direct_acc, "agree": agree}
    print(json.dumps({**row, "lm_eval_seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
