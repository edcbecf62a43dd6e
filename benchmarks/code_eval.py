"""Code evaluation on held-out standard-library files: the diffusion code model against its AR twin.

(a) Infilling. Spans are cut from the test files (recipes/data/code/test.jsonl): a line, an expression
    (an AST expression node spanning part of one line) and a function body (a whole small `def`'s body),
    each at most --max-middle tokens. The diffusion model fills the middle seeing both sides
    (`dgemma.infill`, the middle length chosen by the model from 2, 4, 8, ... and also given exactly); the
    AR twin sees only the left side and decodes greedily exactly as many tokens as the true middle (an
    oracle length, generous to it). Scores: exact match of the middle (whitespace at its ends ignored) and
    `ast.parse` validity of the reassembled file. The baseline of the parse rate is the empty fill: the
    file with the span deleted (prefix + suffix), which parses more often than one might think (a
    deleted function body or expression rarely does, a deleted line often does).
(b) Continuation. From the start of a top-level statement, one canvas of new tokens; a snippet "parses"
    when the prefix plus the snippet cut at its last complete line parses (an open block at the end is
    closed with `pass`).
    The AR twin also scores every continuation (its perplexity of the snippet after the prefix): how
    likely the base finds what each model wrote, its own greedy text being the floor.
(c) Speed on this CPU: tokens/s and tokens per forward, diffusion vs the AR twin.

Prints a table, writes a PNG plot, ends with one JSON line.

    python benchmarks/code_eval.py [--model DIR] [--ar-model DIR] [--spans 100] [--snippets 30]
    python benchmarks/code_eval.py --baseline-only    # the empty-fill baseline on the same spans (seconds)

By default: the shipped code model (dgemma/models/code) and its AR twin (models/code-ar, beside the package).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

import dgemma
from dgemma.generation.engine import score as encoder_score
from dgemma.tasks import code

ROOT = Path(__file__).resolve().parent.parent
KINDS = code.SPAN_KINDS


def spans(text: str, rng: random.Random, tok, max_tokens: int, per_kind: int) -> list[tuple[str, int, int]]:
    """(kind, start, end) character spans of one file to remove and fill back."""
    found = code.syntax_spans(text, lambda s: len(tok.encode(s, add_special_tokens=False)), max_tokens)
    out = []
    for kind in KINDS:
        picks = sorted(set(found[kind]))
        rng.shuffle(picks)
        out += [(kind, a, b) for a, b in picks[:per_kind]]
    return out


def held_out_cases(files: list[dict], rng: random.Random, tok, max_middle: int, per_kind: int) -> dict[str, list]:
    """Up to `per_kind` (kind, text, start, end) spans of each kind, drawn from the files with `rng`."""
    cases = [(k, f["text"], a, b) for f in files for k, a, b in spans(f["text"], rng, tok, max_middle, per_kind=3)]
    rng.shuffle(cases)
    return {k: [c for c in cases if c[0] == k][:per_kind] for k in KINDS}


def _tail(ids: list[int], n: int) -> list[int]:
    return ids[-n:] if n else ids


def infill_inputs(tok, text: str, a: int, b: int, context: int) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the span's left context (its last `context` tokens, or BOS), the middle and the suffix."""
    prefix = tok.encode(text[:a], add_special_tokens=False)
    middle = tok.encode(text[a:b], add_special_tokens=False)
    suffix = tok.encode(text[b:], add_special_tokens=False)
    return _tail(prefix, context) or [tok.bos_token_id], middle, suffix


def infill_case(model, ar_model, tok, text: str, a: int, b: int, context: int) -> dict:
    left, middle, suffix = infill_inputs(tok, text, a, b, context)
    truth = text[a:b].strip()
    out = {}
    for name, length in (("auto", "auto"), ("given", len(middle))):
        r = dgemma.infill(model, left, suffix, middle_length=length, tokenizer=tok, seed=0)
        filled = r.middle_text
        out[f"diffusion_{name}"] = _score(text, a, b, filled, truth, r.result.stats)
    if ar_model is not None:
        r = dgemma.generate_ar(ar_model, left, len(middle), stop_token_ids=[])
        filled = tok.decode(r.tokens[0])
        out["ar"] = _score(text, a, b, filled, truth, r.stats)
    return out


def fill_parses(text: str, a: int, b: int, filled: str) -> bool:
    """Whether the file with `text[a:b]` replaced by `filled` parses."""
    try:
        ast.parse(text[:a] + filled + text[b:])
        return True
    except (SyntaxError, ValueError):
        return False


def _score(text: str, a: int, b: int, filled: str, truth: str, stats) -> dict:
    parses = fill_parses(text, a, b, filled)
    return {"exact": filled.strip() == truth, "parses": parses, "forwards": stats.decoder_forward_passes[0]}


def empty_fill_baseline(chosen: dict[str, list]) -> dict[str, dict]:
    """Per kind (and "all"): how often the file parses with the span simply deleted (an empty fill)."""
    out = {}
    for kind, group in [*chosen.items(), ("all", [c for g in chosen.values() for c in g])]:
        hits = sum(fill_parses(text, a, b, "") for _, text, a, b in group)
        out[kind] = {"parses": hits / max(len(group), 1), "n": len(group)}
    return out


def load_test_files(path: Path) -> list[dict]:
    """The held-out files: `path` (recipes/code_data.py's test.jsonl), or when it was not built, the same
    test split collected here from this Python's standard library (a file's split is a hash of its path)."""
    if path.is_file():
        return [json.loads(line) for line in path.read_text().splitlines()]
    print(f"{path} not found: collecting the test split from this Python's standard library", file=sys.stderr)
    return [{"path": f.path, "text": f.text} for f in code.collect() if f.split == "test"]


def snippet_parses(prefix: str, snippet: str) -> bool:
    """Whether the prefix plus the snippet cut at its last complete line parses (an open block closed);
    a snippet without one complete non-empty line does not count as parsing."""
    cut = snippet[: snippet.rfind("\n") + 1] if "\n" in snippet else ""
    if not cut.strip():
        return False
    candidate = prefix + cut
    for extra in ("", "    pass\n", "        pass\n", "            pass\n"):
        try:
            ast.parse(candidate + extra)
            return True
        except (SyntaxError, ValueError):
            continue
    return False


def continuation_cases(files: list[dict], rng: random.Random, n: int) -> list[tuple[str, str]]:
    """(file text, prefix) pairs: prefixes end right before a top-level statement (they parse)."""
    cases = []
    for f in files:
        tree = ast.parse(f["text"])
        starts = code.line_starts(f["text"])
        for node in tree.body[1:]:
            cases.append((f["text"], f["text"][: starts[node.lineno - 1]]))
    rng.shuffle(cases)
    return cases[:n]


def continuations(model, ar_model, tok, cases: list[tuple[str, str]], context: int) -> tuple[dict, dict, dict]:
    """One canvas of new tokens from each prefix, by the diffusion model and (when given) greedily by the AR
    twin. Per model: whether each snippet parses, [tokens, seconds, forwards], and the AR twin's negative
    log-likelihood of the snippets after their prefixes as [nats, tokens] (how likely the base finds them)."""
    canvas = model.config.canvas_length
    parses: dict[str, list[bool]] = {"diffusion": [], "ar": []}
    speed = {"diffusion": [0, 0.0, 0], "ar": [0, 0.0, 0]}
    nll = {"diffusion": [0.0, 0], "ar": [0.0, 0]}
    for _, prefix in cases:
        left = _tail(tok.encode(prefix, add_special_tokens=False), context)
        runs = [("diffusion", lambda ids=left: dgemma.generate(model, ids, max_new_tokens=canvas, seed=0))]
        if ar_model is not None:
            runs.append(("ar", lambda ids=left: dgemma.generate_ar(ar_model, ids, canvas)))
        for name, run in runs:
            t = time.perf_counter()
            r = run()
            new = list(r.tokens[0])
            speed[name][0] += len(new)
            speed[name][1] += time.perf_counter() - t
            speed[name][2] += r.stats.decoder_forward_passes[0] if name == "diffusion" else len(new)
            parses[name].append(snippet_parses(prefix, tok.decode(new)))
            if ar_model is not None and new:
                nll[name][0] -= float(encoder_score(ar_model, left, [new]).logprobs[0].sum())
                nll[name][1] += len(new)
    return parses, speed, nll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "dgemma" / "models" / "code")
    ap.add_argument("--ar-model", type=Path, default=ROOT / "models" / "code-ar")
    ap.add_argument("--data", type=Path, default=ROOT / "recipes" / "data" / "code" / "test.jsonl")
    ap.add_argument("--spans", type=int, default=100, help="spans per kind (default 100)")
    ap.add_argument("--snippets", type=int, default=30, help="continuation prompts (default 30)")
    ap.add_argument("--max-middle", type=int, default=24, help="longest middle in tokens (default 24)")
    ap.add_argument("--context", type=int, default=192, help="prompt tokens kept before the span")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "code_eval.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--baseline-only",
        action="store_true",
        help="only the empty-fill baseline on the same spans (no model runs; the tokenizer picks the spans)",
    )
    args = ap.parse_args()
    files = load_test_files(args.data)
    tok = dgemma.Tokenizer.from_dir(args.model)
    rng = random.Random(args.seed)
    chosen = held_out_cases(files, rng, tok, args.max_middle, args.spans)
    baseline = empty_fill_baseline(chosen)
    if args.baseline_only:
        _print_baseline(baseline)
        print(json.dumps({"benchmark": "code_eval", "baseline_empty_fill": baseline}))
        return
    model = dgemma.load(args.model)
    model = dgemma.accelerate(model)
    ar_model = None
    if (args.ar_model / "config.json").is_file():
        ar_model = dgemma.load(args.ar_model)
        ar_model = dgemma.accelerate(ar_model)

    infill: dict[str, dict[str, list[dict]]] = {k: {} for k in KINDS}
    t0 = time.perf_counter()
    for kind, group in chosen.items():
        for _, text, a, b in group:
            for name, score in infill_case(model, ar_model, tok, text, a, b, args.context).items():
                infill[kind].setdefault(name, []).append(score)
    infill_seconds = time.perf_counter() - t0

    cont, speed, nll = continuations(model, ar_model, tok, continuation_cases(files, rng, args.snippets), args.context)

    def rate(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows) / max(len(rows), 1)

    summary = {"benchmark": "code_eval", "infill": {}, "continuation": {}, "speed": {}}
    summary["baseline_empty_fill"] = baseline
    print(f"infilling on held-out files ({args.data.name}), {infill_seconds:.0f} s")
    print("| span | n | diffusion (auto length) | diffusion (given length) | AR twin (left only) | empty fill |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in KINDS:
        row = infill[kind]
        cells = []
        for name in ("diffusion_auto", "diffusion_given", "ar"):
            if name in row:
                cells.append(f"{rate(row[name], 'exact'):6.1%} / {rate(row[name], 'parses'):6.1%}")
                summary["infill"].setdefault(kind, {})[name] = {
                    "exact": rate(row[name], "exact"),
                    "parses": rate(row[name], "parses"),
                    "n": len(row[name]),
                }
            else:
                cells.append("-")
        empty = f"- / {baseline[kind]['parses']:6.1%}"
        print(f"| {kind} | {len(chosen[kind])} | {cells[0]:>24} | {cells[1]:>24} | {cells[2]:>20} | {empty:>10} |")
    print("(exact match / reassembled file parses; empty fill: the span deleted)\n")
    for name, rows in cont.items():
        if rows:
            summary["continuation"][name] = {"parses": sum(rows) / len(rows), "n": len(rows)}
    for name, (tokens, seconds, forwards) in speed.items():
        if tokens:
            summary["speed"][name] = {"tokens_per_s": tokens / seconds, "tokens_per_forward": tokens / forwards}
        if nll[name][1]:
            summary["continuation"][name]["ar_perplexity"] = math.exp(nll[name][0] / nll[name][1])
    print("| model | continuation parses | AR twin's perplexity of it | tokens/s | tokens per forward |")
    print("|---|---:|---:|---:|---:|")
    for name in ("diffusion", "ar"):
        if name in summary["speed"]:
            c, s = summary["continuation"][name], summary["speed"][name]
            ppl = f"{c['ar_perplexity']:.2f}" if "ar_perplexity" in c else "-"
            print(
                f"| {name} | {c['parses']:.1%} ({c['n']}) | {ppl} | {s['tokens_per_s']:.0f} | "
                f"{s['tokens_per_forward']:.2f} |"
            )
    print("(perplexity: the AR twin scoring each continuation after its prefix; its own greedy text is its floor)")
    _plot(summary, args.plot)
    print(f"plot: {args.plot}")
    print(json.dumps(summary))


def _print_baseline(baseline: dict[str, dict]) -> None:
    print("| span | n | empty fill parses |")
    print("|---|---:|---:|")
    for kind, row in baseline.items():
        print(f"| {kind} | {row['n']} | {row['parses']:.1%} |")
    print("(the file with the span deleted: the floor any fill's parse rate should be read against)")


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8), dpi=120)
    names = [
        ("diffusion_auto", "diffusion, auto length"),
        ("diffusion_given", "diffusion, given length"),
        ("ar", "AR twin (left side only)"),
    ]
    width = 0.27
    for ax, (metric, label) in zip(axes, (("exact", "exact match (%)"), ("parses", "file parses (%)")), strict=True):
        for i, (key, name) in enumerate(names):
            values = [100 * summary["infill"].get(k, {}).get(key, {}).get(metric, 0.0) for k in KINDS]
            ax.bar([x + (i - 1) * width for x in range(len(KINDS))], values, width, label=name)
        if metric == "parses":  # what deleting the span gives: the floor of the parse rate
            floor = [100 * summary["baseline_empty_fill"][k]["parses"] for k in KINDS]
            starts, ends = [x - 1.5 * width for x in range(len(KINDS))], [x + 1.5 * width for x in range(len(KINDS))]
            lines = ax.hlines(floor, starts, ends, colors="black", linestyles="--", label="empty fill (span deleted)")
            ax.legend(handles=[lines], fontsize=8)
        ax.set_xticks(range(len(KINDS)), KINDS)
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Held-out infilling: diffusion (both sides) vs AR twin (left side)")
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
