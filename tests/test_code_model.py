"""The code model shipped inside the package (no download) is trained: it predicts held-out-style Python
far better than chance, repairs a corrupted canvas in one denoising pass, and is what the commands use
by default."""

from __future__ import annotations

import math

import torch

import dgemma
from dgemma.tasks.code import MODEL_DIR

# Python in the standard library's style, written for this test (not in the training corpus).
SNIPPET = '''def count_words(path, encoding="utf-8"):
    """Return a dict mapping each word in the file to the number of times it occurs."""
    counts = {}
    with open(path, encoding=encoding) as f:
        for line in f:
            for word in line.split():
                counts[word] = counts.get(word, 0) + 1
    return counts


class Stack:
    """A last-in, first-out stack."""

    def __init__(self):
        self._items = []

    def push(self, item):
        self._items.append(item)

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        return self._items.pop()
'''


def _model():
    assert (MODEL_DIR / "model.safetensors").is_file(), "the code model ships inside the package"
    return dgemma.load(MODEL_DIR), dgemma.Tokenizer.from_dir(MODEL_DIR)


@torch.no_grad()
def test_shipped_model_predicts_code():
    model, tok = _model()
    ids = torch.tensor([tok.encode(SNIPPET)])
    cache = model.new_cache(batch_size=1, max_length=ids.shape[1] + 8)
    logits = model.encode(ids, cache, return_logits=True).logits[0, :-1].float()
    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()
    assert loss < 0.5 * math.log(model.text_config.vocab_size), loss  # chance: ln(4096) = 8.3; shipped: 2.9


@torch.no_grad()
def test_shipped_model_repairs_a_corrupted_canvas():
    model, tok = _model()
    ids = tok.encode(SNIPPET)
    c = model.config.canvas_length
    prompt, truth = torch.tensor([ids[:-c]]), torch.tensor([ids[-c:]])
    g = torch.Generator().manual_seed(0)
    noisy = torch.rand(truth.shape, generator=g) < 0.3
    canvas = torch.where(noisy, torch.randint(0, model.text_config.vocab_size, truth.shape, generator=g), truth)
    cache = model.new_cache(batch_size=1, max_length=prompt.shape[1] + c)
    model.encode(prompt, cache)
    guess = model.denoise(canvas, cache).argmax(-1)
    repaired = (guess == truth)[noisy].float().mean().item()
    assert repaired > 0.25, repaired  # chance: 1 / 4096 (the shipped model: 0.375)


def _code_eval():
    """benchmarks/code_eval.py as a module (benchmarks are scripts, not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "code_eval.py"
    spec = importlib.util.spec_from_file_location("code_eval", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_eval_empty_fill_baseline_deletes_the_span():
    code_eval = _code_eval()
    text = "def f(x):\n    y = (x + 1)\n    return y\n"
    line = (text.index("    y"), text.index("    return"))  # deleting the line leaves `return y`: parses
    expression = (text.index("(x +"), text.index("1)") + 2)  # `y = ` alone does not parse
    body = (text.index("    y"), len(text))  # `def f(x):` without a body does not parse
    chosen = {
        kind: [(kind, text, a, b)] for kind, (a, b) in zip(code_eval.KINDS, (line, expression, body), strict=True)
    }
    baseline = code_eval.empty_fill_baseline(chosen)
    assert {k: v["parses"] for k, v in baseline.items()} == {"line": 1.0, "expression": 0.0, "body": 0.0, "all": 1 / 3}
    assert baseline["all"]["n"] == 3 and code_eval.fill_parses(text, *expression, "x")


def test_code_eval_baseline_only_runs_without_a_model(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"path": "m.py", "text": SNIPPET}) + "\n")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "code_eval.py"
    out = subprocess.run(
        [sys.executable, str(script), "--baseline-only", "--data", str(data), "--model", str(MODEL_DIR)],
        capture_output=True, text=True, check=True, timeout=300,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])["baseline_empty_fill"]
    code_eval = _code_eval()
    import random

    tok = dgemma.Tokenizer.from_dir(MODEL_DIR)
    chosen = code_eval.held_out_cases([{"text": SNIPPET}], random.Random(0), tok, 24, 100)
    assert result == code_eval.empty_fill_baseline(chosen) and result["all"]["n"] > 0


def test_code_eval_continuations_are_scored_by_the_ar_twin():
    """code_eval's continuation pass: each snippet's tokens are scored by the AR twin (its perplexity of what
    each model wrote); the twin's own greedy tokens are its argmax at every position of that scoring."""
    from dgemma.generation.engine import score

    code_eval = _code_eval()
    model, tok = dgemma.load(MODEL_DIR), dgemma.Tokenizer.from_dir(MODEL_DIR)
    prefix = SNIPPET[: SNIPPET.index("class Stack")]
    parses, speed, nll = code_eval.continuations(model, model, tok, [(SNIPPET, prefix)], context=64)
    for name in ("diffusion", "ar"):
        assert len(parses[name]) == 1 and nll[name][1] == speed[name][0] > 0 and nll[name][0] > 0
    left = tok.encode(prefix, add_special_tokens=False)[-64:]
    greedy = dgemma.generate_ar(model, left, model.config.canvas_length).tokens[0]
    scored = score(model, left, [list(greedy)], top=1)
    best = torch.tensor([row[0][1] for row in scored.top[0]])
    # each greedy token is the scoring's top choice, up to the summation-order difference of the two paths
    torch.testing.assert_close(scored.logprobs[0], best, rtol=0, atol=1e-4)
    assert math.isclose(-float(scored.logprobs[0].sum()), nll["ar"][0], rel_tol=1e-5)  # the same tokens, scored
