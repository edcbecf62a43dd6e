"""`dgemma analyze`: how a model's canvases commit their tokens (dgemma.tracing), measured (dgemma.analysis)
and drawn.

Traces prompts (`-p`, `--prompts FILE.jsonl`) or a task on its shipped model (`--task sudoku|code|infill|extract`)
and writes traces.jsonl, stats.json and pictures to `--out`. Inputs, outputs and the study: docs/commitment.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .common import add_model_args, add_sampling_args, load_model_and_tokenizer, positive_int, sampling_overrides

TASKS = ("sudoku", "code", "infill", "extract")


@dataclass
class Case:
    """One generation to trace: its prompt, its template (pins) if any, the right tokens if known."""

    prompt: list[int]
    pins: list[int | None] | None = None  # a template to fill (None: a free generation)
    reference: list[int] | None = None  # the right token of each generated position, from the first
    meta: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)  # SamplingParams fields of its own (a length)


def _default_model(task: str | None) -> Path | None:
    from ..tasks import code, extract, sudoku

    return {
        "sudoku": sudoku.MODEL_DIR,
        "code": code.MODEL_DIR,
        "infill": code.MODEL_DIR,
        "extract": extract.MODEL_DIR,
    }.get(task)


def sudoku_cases(tok, n: int, seed: int) -> list[Case]:
    """Fresh puzzles (seeds far from the training sets'), clues pinned, the solution as reference."""
    from ..tasks import sudoku

    cases = []
    for i in range(n):
        p = sudoku.generate(500_000_000 + seed + i)
        ref = sudoku.solution_ids(tok, p.solution)
        meta = {"task": "sudoku", "puzzle": p.puzzle, "level": p.level}
        cases.append(Case(sudoku.prompt_ids(tok, p.puzzle), sudoku.template(tok, p.puzzle), ref, meta))
    return cases


def _test_files() -> list[str]:
    from ..tasks import code

    return [f.text for f in code.collect() if f.split == "test"]


def code_cases(model, tok, n: int, seed: int, infill: bool) -> list[Case]:
    """Held-out files cut at a line start: a continuation of `context` tokens, or (infill) 2-6 lines cut
    out and filled at their true length between the prefix and the suffix."""
    from ..generation.editing import infill_template, max_middle_length

    rng, files, canvas = random.Random(seed), _test_files(), model.config.canvas_length
    cases = []
    while len(cases) < n:
        text = rng.choice(files)
        starts = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
        if len(starts) < 40:
            continue
        k = rng.randrange(10, len(starts) - 12)
        a = starts[k]
        prefix = tok.encode(text[:a], add_special_tokens=False)[-192:]
        if not infill:  # one canvas; no reference: a continuation has many right answers
            cases.append(Case(prefix, None, None, {"task": "code"}, {"max_new_tokens": canvas}))
            continue
        b = starts[k + rng.randint(2, 6)]
        middle = tok.encode(text[a:b], add_special_tokens=False)
        if not 0 < len(middle) <= max_middle_length(model):
            continue
        suffix = tok.encode(text[b:], add_special_tokens=False)[:canvas]
        template = infill_template(model, suffix, len(middle))
        cases.append(Case(prefix, template, middle, {"task": "infill", "middle_tokens": len(middle)}))
    return cases


def extract_cases(tok, n: int, seed: int) -> list[Case]:
    """Held-out orders, the answer JSON as reference."""
    from ..tasks import extract

    first = extract.SPLITS["test"][0] + seed
    cases = []
    for i in range(n):
        sentence, order = extract.example(first + i)
        prompt = tok.apply_chat_template(extract.messages(sentence), add_generation_prompt=True)
        cases.append(
            Case(prompt, None, tok.encode(extract.answer(order), add_special_tokens=False), {"task": "extract"})
        )
    return cases


def prompt_cases(tok, prompts: list[tuple[str, str | None]], raw: bool) -> list[Case]:
    """Given prompts (and references): the chat template applied unless `raw` (or the tokenizer has none)."""
    cases = []
    for text, reference in prompts:
        if raw or not tok.chat_template:
            ids = tok.encode(text)
        else:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        ref = None if reference is None else tok.encode(reference, add_special_tokens=False)
        cases.append(Case(ids, None, ref, {"prompt": text}))
    return cases


def read_prompts(path: Path) -> list[tuple[str, str | None]]:
    """(prompt, reference or None) per line of a JSONL file; a ValueError naming the line otherwise."""
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from e
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{path}:{i}: each line needs a "prompt" text')
        reference = record.get("reference")
        if reference is not None and not isinstance(reference, str):
            raise ValueError(f'{path}:{i}: "reference" must be a text')
        out.append((record["prompt"], reference))
    if not out:
        raise ValueError(f"{path} holds no prompt")
    return out


def run_traces(runner, tok, cases: list[Case], settings: dict, progress: bool):
    """A trace per case, with a progress bar."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from ..generation.editing import template_pins
    from ..tracing import trace

    traces = []
    columns = (TextColumn("tracing"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, disable=not progress, transient=True) as bar:
        job = bar.add_task("tracing", total=len(cases))
        for i, case in enumerate(cases):
            kw = dict(settings, seed=settings["seed"] + i, **case.settings)
            if case.pins is not None:  # a template, filled to its full length as dgemma.fill fills one
                pins = template_pins([case.pins])
                kw.update(pins=pins, max_new_tokens=pins.shape[1], stop_token_ids=[])
            t = trace(runner, case.prompt, tokenizer=tok, **kw)
            t.meta = dict(case.meta, reference=case.reference)
            traces.append(t)
            bar.advance(job)
    return traces


def right_tokens(trace, canvas) -> np.ndarray:
    """[C] per position of a canvas: 1 if it holds its reference token, 0 if not, -1 past the reference."""
    ref = trace.meta.get("reference") or []
    c = canvas.tokens.shape[0]
    part = np.asarray(ref[canvas.index * c : (canvas.index + 1) * c], dtype=np.int64)
    out = np.full(c, -1, dtype=np.int8)
    out[: len(part)] = canvas.tokens[: len(part)] == part
    return out


def sudoku_figures(traces) -> dict:
    """Blank cells: Spearman's rho of constraint count (distinct clue digits among peers) and
    finalisation step, per puzzle, averaged; and the mean step by constraint count."""
    from ..analysis import spearman
    from ..tasks.sudoku import BLANK, PEERS

    rhos, by_count = [], {}
    for t in traces:
        puzzle, c = t.meta["puzzle"], t.canvases[0]
        blanks = [i for i in range(81) if puzzle[i] == BLANK]
        counts = [len({puzzle[p] for p in PEERS[i]} - {BLANK}) for i in blanks]
        steps = [int(c.final_step[i]) for i in blanks]
        rho = spearman(counts, steps)
        if not np.isnan(rho):
            rhos.append(rho)
        for k, s in zip(counts, steps, strict=True):
            by_count.setdefault(k, []).append(s)
    mean_by = {str(k): round(float(np.mean(v)), 2) for k, v in sorted(by_count.items())}
    return {"constraints_vs_step_rho": float(np.mean(rhos)) if rhos else None, "mean_step_by_constraints": mean_by}


# ------------------------------------------------------------------------------------------------
# Pictures


def _pyplot():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("the pictures need matplotlib: pip install 'dgemma[analyze]' (or matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, ax, title: str, path: Path, size: int = 10) -> None:
    ax.set_title(title, fontsize=size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_heatmap(traces, path: Path, title: str) -> None:
    """Finalisation step by position: a row per canvas, positions that are not content left blank."""
    plt = _pyplot()
    rows = [np.where(c.content, c.final_step, np.nan).astype(float) for t in traces for c in t.canvases]
    grid = np.stack(rows)
    fig, ax = plt.subplots(figsize=(9, max(2.2, min(0.12 * len(rows) + 1.2, 9))))
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(im, ax=ax, label="step finalised")
    ax.set_xlabel("position in the canvas")
    ax.set_ylabel("canvas")
    _save(plt, fig, ax, title, path)


def draw_commits(traces, path: Path, title: str) -> None:
    """Mean positions finalised and accepted per step, and the content's mean entropy."""
    plt = _pyplot()
    canvases = [c for t in traces for c in t.canvases if c.content.any()]
    longest = max(c.steps for c in canvases)

    def mean_of(values) -> np.ndarray:
        total, count = np.zeros(longest), np.zeros(longest)
        for v in values:
            total[: len(v)] += np.nan_to_num(v)
            count[: len(v)] += 1
        return total / np.maximum(count, 1)

    steps = np.arange(1, longest + 1)
    fig, ax = plt.subplots(figsize=(8, 3.8))
    ax.bar(steps, mean_of(c.finalised_per_step for c in canvases), color="tab:blue", label="finalised")
    ax.plot(steps, mean_of(c.accepted_per_step for c in canvases), color="tab:orange", marker=".", label="accepted")
    ax.set_xlabel("denoising step")
    ax.set_ylabel("positions per canvas (mean)")
    twin = ax.twinx()
    twin.plot(steps, mean_of(c.mean_entropy for c in canvases), color="tab:gray", ls="--", label="mean entropy")
    twin.set_ylabel("mean entropy (nats)")
    lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="upper center", fontsize=8)
    _save(plt, fig, ax, title, path)


def draw_calibration(cal, path: Path, title: str) -> None:
    """Accuracy against mean confidence at commit, per confidence bin (point size: count)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.6, 4.4))
    ax.plot([0, 1], [0, 1], color="gray", ls=":")
    conf, acc, n = (np.array([b[i] for b in cal.bins]) for i in (3, 4, 2))
    ax.plot(conf, acc, color="tab:blue")
    ax.scatter(conf, acc, s=12 + 200 * n / max(n.max(), 1), color="tab:blue")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence at commit")
    ax.set_ylabel("share of right tokens")
    _save(plt, fig, ax, f"{title}\nAUROC {cal.auroc:.3f}, ECE {cal.ece:.3f}, {cal.count} tokens", path, 9)


def draw_sudoku(traces, path: Path) -> None:
    """Mean finalisation step of each cell over the puzzles where it was blank (clues: blank)."""
    plt = _pyplot()
    total, count = np.zeros(81), np.zeros(81)
    for t in traces:
        c = t.canvases[0]
        total[c.content] += c.final_step[c.content]
        count[c.content] += 1
    grid = np.where(count > 0, total / np.maximum(count, 1), np.nan).reshape(9, 9)
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    im = ax.imshow(grid, cmap="viridis")
    fig.colorbar(im, ax=ax, label="mean step finalised")
    for k in (2.5, 5.5):
        ax.axhline(k, color="white", lw=2)
        ax.axvline(k, color="white", lw=2)
    ax.set_xticks([])
    ax.set_yticks([])
    _save(plt, fig, ax, f"Sudoku: mean step each cell is finalised ({len(traces)} puzzles)", path, 9)


# ------------------------------------------------------------------------------------------------
# The command


def _cases(args, runner, tok) -> list[Case]:
    model, seed = runner.model, args.seed or 0
    if args.task == "sudoku":
        return sudoku_cases(tok, args.n, seed)
    if args.task in ("code", "infill"):
        return code_cases(model, tok, args.n, seed, infill=args.task == "infill")
    if args.task == "extract":
        return extract_cases(tok, args.n, seed)
    prompts = read_prompts(args.prompts) if args.prompts else [(p, None) for p in args.prompt]
    return prompt_cases(tok, prompts, args.raw)


def stats_of(traces, tok, task: str | None) -> dict:
    """What stats.json holds: the summary, the calibration where references exist, the task's figures."""
    from .. import analysis

    texts = (lambda ids: [tok.token_texts[i] for i in ids]) if task in (None, "code", "infill") else None
    out = {"task": task, **analysis.summary(traces, texts=texts)}
    if all(t.meta.get("reference") for t in traces):
        cal = analysis.calibration(traces, right_tokens)
        out["calibration"] = {"auroc": cal.auroc, "ece": cal.ece, "accuracy": cal.accuracy, "tokens": cal.count}
        out["calibration"]["bins"] = [
            dict(zip(("low", "high", "count", "confidence", "accuracy"), b, strict=True)) for b in cal.bins
        ]
    if task == "sudoku":
        out["sudoku"] = sudoku_figures(traces)
    return out


def cmd_analyze(args: argparse.Namespace) -> int:
    """Trace, measure, draw."""
    from .. import analysis

    if sum(x is not None and x != [] for x in (args.prompt, args.prompts, args.task)) != 1:
        raise ValueError("give one of -p PROMPT, --prompts FILE.jsonl or --task")
    if args.model is None and args.task is not None:
        args.model = _default_model(args.task)
    runner, tok = load_model_and_tokenizer(args)
    cases = _cases(args, runner, tok)
    settings = {"seed": 0, **sampling_overrides(args)}  # generation i draws with seed + i: reruns agree
    traces = run_traces(runner, tok, cases, settings, progress=sys.stderr.isatty())
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    with (out / "traces.jsonl.tmp").open("w") as f:
        for t in traces:
            f.write(json.dumps(t.to_dict()) + "\n")
    (out / "traces.jsonl.tmp").replace(out / "traces.jsonl")
    stats = stats_of(traces, tok, args.task)
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    name = args.task or "prompts"
    ltr = stats["left_to_right"]["token"]
    pictures = []
    if not args.no_pictures:
        draw_heatmap(traces, out / "heatmap.png", f"{name}: step each position is finalised (token rho {ltr:.2f})")
        draw_commits(traces, out / "commits.png", f"{name}: commits per step")
        pictures = ["heatmap.png", "commits.png"]
        if "calibration" in stats:
            draw_calibration(analysis.calibration(traces, right_tokens), out / "calibration.png", name)
            pictures.append("calibration.png")
        if args.task == "sudoku":
            draw_sudoku(traces, out / "sudoku.png")
            pictures.append("sudoku.png")
    _print_summary(stats, out, pictures)
    return 0


def _print_summary(stats: dict, out: Path, pictures: list[str]) -> None:
    ltr, burst = stats["left_to_right"], stats["late_burst"]
    print(f"{stats['generations']} generations, {stats['canvases']} canvases, {stats['content_tokens']} tokens")
    print("left-to-right rho: " + ", ".join(f"{k} {v:.3f}" for k, v in ltr.items()))
    sizes = stats["commit_sizes"]
    largest, busy = sizes["largest_share"], sizes["steps_with_commits"]
    print(f"largest commit: {largest:.1%} of a canvas; steps that commit: {busy:.1f}")
    share, used = burst["share"], burst["steps_used"]
    print(f"late burst: {share:.1%} finalised in the last {burst['k']} steps; {used:.0%} of the budget used")
    print(f"tokens per forward: {stats['tokens_per_forward']:.2f}")
    if "calibration" in stats:
        cal = stats["calibration"]
        print(f"calibration: AUROC {cal['auroc']:.3f}, ECE {cal['ece']:.3f}, accuracy {cal['accuracy']:.1%}")
    if "sudoku" in stats:
        print(f"sudoku: constraint count vs step rho {stats['sudoku']['constraints_vs_step_rho']:.3f}")
    print(f"wrote {out}/traces.jsonl, stats.json" + "".join(f", {p}" for p in pictures))


def register(sub) -> None:
    """Add `analyze` to the `dgemma` subcommands."""
    p = sub.add_parser(
        "analyze",
        help="trace how canvases commit their tokens: statistics and pictures",
        description=__doc__.split("\n\n")[0] + " See docs/commitment.md.",
        epilog="examples:\n  dgemma analyze --task sudoku --out runs/analyze-sudoku\n"
        "  dgemma analyze -m DIR --prompts prompts.jsonl --out runs/analyze",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    src = p.add_argument_group("what to trace (one of)")
    src.add_argument("-p", "--prompt", action="append", default=[], help="a prompt (repeat for more)")
    src.add_argument("--prompts", type=Path, help='a JSONL file: {"prompt": ..., "reference": ... (optional)} per line')
    src.add_argument("--task", choices=TASKS, help="a task with known answers, on its shipped model by default")
    p.add_argument("--n", type=positive_int, default=24, help="generations for --task (default 24)")
    p.add_argument("--raw", action="store_true", help="no chat template for -p / --prompts")
    p.add_argument("--out", type=Path, default=Path("analyze"), help="output directory (default ./analyze)")
    p.add_argument("--no-pictures", action="store_true", help="statistics and traces only")
    add_sampling_args(p)
    p.set_defaults(func=cmd_analyze)
