"""Sudoku: puzzles with a unique solution, graded difficulty, a solver/validator, datasets, and the model
format (tokens, prompt, canvas).

Grids are strings of 81 characters, row by row, `1`-`9` for digits and `0` for a blank. Grid syntax,
difficulty levels and the model format: docs/sudoku.md.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

DIGITS = "123456789"
BLANK = "0"
LEVELS = ("easy", "medium", "hard")

# Peers of each cell: same row, column or box.
ROWS = [[r * 9 + c for c in range(9)] for r in range(9)]
COLS = [[r * 9 + c for r in range(9)] for c in range(9)]
BOXES = [[(br * 3 + r) * 9 + bc * 3 + c for r in range(3) for c in range(3)] for br in range(3) for bc in range(3)]
UNITS = ROWS + COLS + BOXES
PEERS = [sorted({p for u in UNITS if i in u for p in u} - {i}) for i in range(81)]
ALL = 0x1FF  # nine candidate bits


class SudokuError(ValueError):
    """An unusable puzzle string; the message says why."""


# ------------------------------------------------------------------------------------------------
# Parsing and checking


def parse(text: str) -> str:
    """Normalise a puzzle to 81 characters of 0-9 (0 = blank), or raise SudokuError saying what is wrong."""
    cells = [ch for ch in text if not ch.isspace() and ch not in "|-+"]
    bad = sorted({ch for ch in cells if ch not in "0123456789."})
    if bad:
        raise SudokuError(f"a puzzle holds digits 1-9 and 0 or '.' for blanks; found {''.join(bad)!r}")
    if len(cells) != 81:
        raise SudokuError(f"a puzzle has 81 cells; found {len(cells)}")
    return "".join(BLANK if ch == "." else ch for ch in cells)


def conflicts(grid: str) -> list[tuple[int, int]]:
    """Pairs of cells that hold the same digit in one row, column or box."""
    out = []
    for i, ch in enumerate(grid):
        if ch != BLANK:
            out += [(i, p) for p in PEERS[i] if p > i and grid[p] == ch]
    return out


def units_complete(grid: str) -> float:
    """The share of the 27 rows, columns and boxes that hold the nine digits exactly once."""
    units = [[9 * r + c for c in range(9)] for r in range(9)] + [[9 * r + c for r in range(9)] for c in range(9)]
    units += [[9 * (3 * br + r) + 3 * bc + c for r in range(3) for c in range(3)] for br in range(3) for bc in range(3)]
    return sum(sorted(grid[i] for i in unit) == list(DIGITS) for unit in units) / 27


def is_solution(grid: str, puzzle: str | None = None) -> bool:
    """A complete, valid grid (that keeps the puzzle's clues, when given)."""
    if len(grid) != 81 or any(ch not in DIGITS for ch in grid) or conflicts(grid):
        return False
    return puzzle is None or all(p in (BLANK, g) for p, g in zip(puzzle, grid, strict=True))


# ------------------------------------------------------------------------------------------------
# Solving (bitmask search with the most constrained cell first)


def _candidates(grid: list[int]) -> list[int]:
    cand = [ALL] * 81
    for i, d in enumerate(grid):
        if d:
            cand[i] = 0
            bit = 1 << (d - 1)
            for p in PEERS[i]:
                cand[p] &= ~bit
    return cand


BOX_OF = [(i // 27) * 3 + (i % 9) // 3 for i in range(81)]


def _search(grid: list[int], limit: int, out: list[list[int]], rng: random.Random | None) -> None:
    """Depth-first search on row/column/box bitmasks, most constrained blank first; appends up to `limit`
    solutions to `out`. `grid` must hold no conflicting clues."""
    rows, cols, boxes = [0] * 9, [0] * 9, [0] * 9
    empties = []
    for i, d in enumerate(grid):
        if d:
            bit = 1 << (d - 1)
            rows[i // 9] |= bit
            cols[i % 9] |= bit
            boxes[BOX_OF[i]] |= bit
        else:
            empties.append(i)

    def rec() -> None:
        best, best_free, best_count = -1, 0, 10
        for i in empties:
            if grid[i]:
                continue
            free = ALL & ~(rows[i // 9] | cols[i % 9] | boxes[BOX_OF[i]])
            n = bin(free).count("1")
            if n < best_count:
                best, best_free, best_count = i, free, n
                if n <= 1:
                    break
        if best < 0:
            out.append(grid[:])
            return
        if best_count == 0:
            return
        r, c, b = best // 9, best % 9, BOX_OF[best]
        digits = [d for d in range(1, 10) if best_free >> (d - 1) & 1]
        if rng is not None:
            rng.shuffle(digits)
        for d in digits:
            bit = 1 << (d - 1)
            grid[best] = d
            rows[r] |= bit
            cols[c] |= bit
            boxes[b] |= bit
            rec()
            rows[r] &= ~bit
            cols[c] &= ~bit
            boxes[b] &= ~bit
            grid[best] = 0
            if len(out) >= limit:
                return

    rec()


def solutions(puzzle: str, limit: int = 2) -> list[str]:
    """Up to `limit` solutions of `puzzle` (81 chars, 0 = blank)."""
    if conflicts(puzzle):
        return []
    out: list[list[int]] = []
    _search([int(ch) for ch in puzzle], limit, out, None)
    return ["".join(map(str, g)) for g in out]


def solve(puzzle: str) -> str:
    """The unique solution of a puzzle, or SudokuError (contradictory clues, no solution, or several)."""
    puzzle = parse(puzzle)
    clash = conflicts(puzzle)
    if clash:
        a, b = clash[0]
        raise SudokuError(
            f"contradictory clues: cells r{a // 9 + 1}c{a % 9 + 1} and r{b // 9 + 1}c{b % 9 + 1} both hold {puzzle[a]}"
        )
    found = solutions(puzzle, 2)
    if not found:
        raise SudokuError("this puzzle has no solution")
    if len(found) > 1:
        raise SudokuError("this puzzle has more than one solution")
    return found[0]


# ------------------------------------------------------------------------------------------------
# Grading


def grade(puzzle: str) -> str:
    """easy / medium / hard: the techniques a logical solver needs (see the module docstring)."""
    grid = [int(ch) for ch in puzzle]
    needed = "easy"
    while 0 in grid:
        cand = _candidates(grid)
        placed = False
        for i in range(81):  # naked singles
            if not grid[i] and bin(cand[i]).count("1") == 1:
                grid[i] = cand[i].bit_length()
                placed = True
        if placed:
            continue
        for unit in UNITS:  # hidden singles
            for d in range(1, 10):
                bit = 1 << (d - 1)
                spots = [i for i in unit if not grid[i] and cand[i] & bit]
                if len(spots) == 1:
                    grid[spots[0]] = d
                    placed = True
                    needed = "medium"
                    break
            if placed:
                break
        if not placed:
            return "hard"
    return needed


# ------------------------------------------------------------------------------------------------
# Generating


def random_solution(rng: random.Random) -> str:
    out: list[list[int]] = []
    _search([0] * 81, 1, out, rng)
    return "".join(map(str, out[0]))


def make_puzzle(rng: random.Random, min_clues: int = 17) -> tuple[str, str]:
    """(puzzle, solution): a random full grid with clues removed in random order while the solution stays
    unique, down to `min_clues` or until no clue can go."""
    solution = random_solution(rng)
    grid = list(solution)
    order = list(range(81))
    rng.shuffle(order)
    clues = 81
    for i in order:
        if clues <= min_clues:
            break
        digit, grid[i] = grid[i], BLANK
        trial = "".join(grid)
        # A removed cell whose peers already rule out every other digit keeps the solution unique.
        cand = _candidates([int(ch) for ch in trial])[i]
        if bin(cand).count("1") == 1 or len(solutions(trial, 2)) == 1:
            clues -= 1
        else:
            grid[i] = digit
    return "".join(grid), solution


def transform(puzzle: str, solution: str, rng: random.Random) -> tuple[str, str]:
    """A random symmetry of a (puzzle, solution) pair: digits relabelled, rows permuted within bands and bands
    permuted, the same for columns, and a transpose half of the time. Every such map keeps a grid valid, the
    solution unique and the difficulty grade unchanged, so it multiplies the training puzzles for free."""
    digits = list("123456789")
    rng.shuffle(digits)
    relabel = {str(d + 1): digits[d] for d in range(9)} | {BLANK: BLANK}

    def lines() -> list[int]:
        bands = [0, 1, 2]
        rng.shuffle(bands)
        order = []
        for b in bands:
            inner = [0, 1, 2]
            rng.shuffle(inner)
            order += [3 * b + i for i in inner]
        return order

    rows, cols, flip = lines(), lines(), rng.random() < 0.5

    def apply(grid: str) -> str:
        out = [relabel[grid[9 * r + c]] for r in rows for c in cols]
        if flip:
            out = [out[9 * c + r] for r in range(9) for c in range(9)]
        return "".join(out)

    return apply(puzzle), apply(solution)


@dataclass(frozen=True)
class Puzzle:
    puzzle: str
    solution: str
    level: str
    clues: int

    def to_json(self) -> str:
        return json.dumps({"puzzle": self.puzzle, "solution": self.solution, "level": self.level, "clues": self.clues})


def generate(seed: int, min_clues: int = 17) -> Puzzle:
    """One graded puzzle, a deterministic function of `seed`; a random clue target gives a spread of
    difficulties (fewer clues -> harder on average)."""
    rng = random.Random(seed)
    puzzle, solution = make_puzzle(rng, min_clues=rng.randint(min_clues, 45))
    return Puzzle(puzzle, solution, grade(puzzle), 81 - puzzle.count(BLANK))


def generate_level(level: str, seed: int, max_tries: int = 200) -> Puzzle:
    """A puzzle of the given difficulty (tries seeds seed, seed + 1, ... until one fits)."""
    if level not in LEVELS:
        raise SudokuError(f"difficulty must be one of {LEVELS} (got {level!r})")
    for k in range(max_tries):
        p = generate(seed * 1000 + k, min_clues=17 if level == "hard" else 22)
        if p.level == level:
            return p
    raise SudokuError(f"no {level} puzzle found in {max_tries} tries")


def _worker(args) -> list[str]:
    start, count = args
    return [generate(s).to_json() for s in range(start, start + count)]


def build_dataset(
    out_dir: str | Path, train: int, validation: int, test: int, seed: int = 0, processes: int = 2, progress=None
) -> dict[str, int]:
    """Write {train,validation,test}.jsonl of graded puzzles. No solution grid is in two splits (a grid and
    its puzzles all go to the split the grid first landed in; duplicates are dropped)."""
    from multiprocessing import Pool

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = train + validation + test
    chunk = 200
    jobs = [(seed * 10**7 + s, min(chunk, total + total // 10 - s)) for s in range(0, total + total // 10, chunk)]
    seen: set[str] = set()
    splits = {"test": [], "validation": [], "train": []}
    targets = {"test": test, "validation": validation, "train": train}
    with Pool(processes) as pool:
        for lines in pool.imap(_worker, jobs):
            for line in lines:
                solution = json.loads(line)["solution"]
                if solution in seen:
                    continue
                seen.add(solution)
                for name in ("test", "validation", "train"):
                    if len(splits[name]) < targets[name]:
                        splits[name].append(line)
                        break
            if progress:
                progress(sum(len(v) for v in splits.values()), total)
            if all(len(splits[n]) >= targets[n] for n in splits):
                break
    for name, lines in splits.items():
        (out / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines))
    return {name: len(lines) for name, lines in splits.items()}


# ------------------------------------------------------------------------------------------------
# The model format

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<sep>"]
CELL_TOKENS = [*list(DIGITS), "."]


def make_tokenizer():
    """The 15-token tokenizer (specials, digits 1-9 and '.'), one token per character."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from ..checkpoints.tokenizer import Tokenizer

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CELL_TOKENS)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    special = {
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "sep_token": "<sep>",
    }
    return Tokenizer(tok, special, None)


def prompt_ids(tokenizer, puzzle: str) -> list[int]:
    text = "".join("." if ch == BLANK else ch for ch in puzzle)
    return [tokenizer.bos_token_id, *tokenizer.encode(text, add_special_tokens=False), tokenizer.token_to_id("<sep>")]


def solution_ids(tokenizer, solution: str) -> list[int]:
    return tokenizer.encode(solution, add_special_tokens=False)


def template(tokenizer, puzzle: str) -> list[int | None]:
    """The canvas with the clues pinned and the blanks to fill (for dgemma.fill)."""
    return [None if ch == BLANK else tokenizer.token_to_id(ch) for ch in puzzle]


def decode_grid(tokenizer, ids: list[int]) -> str:
    """81 model tokens -> 81 characters (anything that is not a digit becomes 0)."""
    text = [tokenizer.id_to_token(i) or "" for i in ids[:81]]
    return "".join(t if t in DIGITS else BLANK for t in text).ljust(81, BLANK)


def to_training_jsonl(src: str | Path, dst: str | Path, tokenizer) -> int:
    """Puzzles JSONL -> training records: prompt_ids, completion_ids, and the clue cells as `pinned` (they are
    pinned in the canvas at inference, so training keeps them clean and does not score them)."""
    n = 0
    with Path(src).open() as f, Path(dst).open("w") as out:
        for line in f:
            p = json.loads(line)
            record = {
                "prompt_ids": prompt_ids(tokenizer, p["puzzle"]),
                "completion_ids": solution_ids(tokenizer, p["solution"]),
                "pinned": [int(ch != BLANK) for ch in p["puzzle"]],
            }
            out.write(json.dumps(record) + "\n")
            n += 1
    return n


# -- the chat format, for fine-tuning the real model (Google's Sudoku guide) -----------------------

CHAT_SYSTEM = (
    "Solve the following Sudoku puzzle. The puzzle is 81 digits, row by row, with 0 for an empty cell. "
    "Answer with the 81 digits of the solved grid, row by row, separated by spaces."
)


def chat_record(puzzle: str, solution: str) -> dict:
    """One chat training record in the guide's format: a system instruction, the puzzle as space-separated
    digits with 0 for blanks as the user turn, the space-separated solution as the model's reply."""
    puzzle, solution = parse(puzzle), parse(solution)
    return {
        "messages": [
            {"role": "system", "content": CHAT_SYSTEM},
            {"role": "user", "content": " ".join(puzzle.replace(BLANK, "0"))},
            {"role": "assistant", "content": " ".join(solution)},
        ]
    }


def to_chat_jsonl(src: str | Path, dst: str | Path) -> int:
    """Puzzles JSONL -> chat records (`messages`) for LoRA fine-tuning of a chat checkpoint."""
    n = 0
    with Path(src).open() as f, Path(dst).open("w") as out:
        for line in f:
            p = json.loads(line)
            out.write(json.dumps(chat_record(p["puzzle"], p["solution"])) + "\n")
            n += 1
    return n


def pretty(grid: str) -> str:
    """A 9 x 9 grid with box separators, blanks as '.'."""
    rows = []
    for r in range(9):
        cells = ["." if ch == BLANK else ch for ch in grid[r * 9 : r * 9 + 9]]
        rows.append(" | ".join(" ".join(cells[c : c + 3]) for c in (0, 3, 6)))
        if r in (2, 5):
            rows.append("------+-------+------")
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------
# Solving with a model

MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "sudoku"


@dataclass
class ModelSolve:
    puzzle: str
    solution: str  # 81 digits (0 where the model produced something that is not a digit)
    solved: bool  # a valid grid that keeps every clue
    clues_kept: bool
    steps: int  # denoising steps the canvas took (summed over attempts)
    result: object  # the GenerationResult of the last attempt
    attempts: int = 1  # canvases denoised for this puzzle (see solve_batch's `attempts`)
    settled: bool = False  # the model's stop rule ended the last canvas (at or before the step cap)


def load_model(path: str | Path | None = None, quant: str | None = None, group_size: int = 64):
    """The Sudoku model and its tokenizer (by default the one shipped inside dgemma), optionally
    quantized as it loads (`quant`: int8, int4 or fp8)."""
    from ..checkpoints.tokenizer import Tokenizer
    from ..checkpoints.weights import load

    directory = Path(path) if path is not None else MODEL_DIR
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(
            f"no Sudoku model in {directory}; train one with recipes/sudoku-tiny.yaml or pass --model DIR"
        )
    return load(directory, quant=quant, group_size=group_size), Tokenizer.from_dir(directory)


RETRY_ON = ("invalid", "unsettled")

# How `dgemma sudoku` solves (docs/sudoku.md). By default, verified retries: up to 40 canvases of at most 8
# denoising steps, a new one while the grid fails the rule check. With retry_on "unsettled", self-verified
# restarts: up to 64 such canvases, a new one while the model's own stop rule has not ended the last; no
# rule check. The rule is made stricter than the checkpoint's (draft unchanged for 2 steps rather than 1,
# mean entropy under 0.002 rather than 0.005) so that fewer wrong grids settle. Both chosen on validation.
SOLVER_DEFAULTS = {
    "invalid": {"max_denoising_steps": 8, "attempts": 40},
    "unsettled": {"max_denoising_steps": 8, "attempts": 64, "confidence_threshold": 0.002, "stability_threshold": 2},
}


def solve_batch(
    model, tokenizer, puzzles: list[str], attempts: int = 1, retry_on: str = "invalid", **sampling
) -> list[ModelSolve]:
    """Solve puzzles with the model: the canvas starts with the clues pinned, the blanks are denoised.

    With `attempts` > 1, a puzzle is denoised again from a fresh random canvas (seed + 1, + 2, ...), up to
    `attempts` canvases in all, while its last canvas is not accepted; `steps` then counts the steps of
    every attempt. What accepts a canvas is `retry_on`:

    - "invalid" (verified retries): the grid passes the rule check (no repeated digit in a row, column or
      box, every clue kept). The check is not a solver, but it is knowledge from outside the model.
    - "unsettled" (self-verified restarts): the model's own stop rule ended the canvas (its draft was
      stable and its mean entropy low, at the latest on the last step). Nothing outside the model is
      consulted; a canvas that settles on a wrong grid is kept, and the last canvas is kept when none
      settles.

    `sampling` goes to `editing.fill` (SamplingParams fields, `seed`, `on_event` to watch the drafts).
    """
    from ..generation.programs import fill

    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, got {attempts}")
    if retry_on not in RETRY_ON:
        raise ValueError(f"retry_on must be one of {RETRY_ON}, got {retry_on!r}")
    accept = (lambda s: s.solved) if retry_on == "invalid" else (lambda s: s.settled)
    seed = sampling.pop("seed", None)
    out: list[ModelSolve | None] = [None] * len(puzzles)
    spent = [0] * len(puzzles)
    todo = list(range(len(puzzles)))
    for attempt in range(attempts):
        batch = [puzzles[i] for i in todo]
        templates = [template(tokenizer, p) for p in batch]
        prompts = [prompt_ids(tokenizer, p) for p in batch]
        result = fill(model, templates, prompts, seed=None if seed is None else seed + attempt, **sampling)
        for row, i in enumerate(todo):
            p = puzzles[i]
            grid = decode_grid(tokenizer, result.tokens[row])
            kept = all(c in (BLANK, g) for c, g in zip(p, grid, strict=True))
            spent[i] += result.stats.steps_per_canvas[row][0]
            settled = result.stats.converged_per_canvas[row][0]
            out[i] = ModelSolve(p, grid, is_solution(grid, p), kept, spent[i], result, attempt + 1, settled)
        todo = [i for i in todo if not accept(out[i])]
        if not todo:
            break
    return out
