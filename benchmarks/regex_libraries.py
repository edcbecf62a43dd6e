"""Regex -> automaton libraries against dgemma's hand-written position automaton (dgemma/structured/regex.py).

For each pattern (the values of REGEX_FORMATS, a few JSON-Schema-style `pattern`s, and a hostname label
of the full RFC length) and each implementation: whether it compiles the pattern as given (the error if
not; a library that refuses the `^`/`$` anchors is then measured on the pattern without them, marked
"stripped"), the median compile time, the number of states, and the disagreements with Python's
`re.fullmatch` on `--strings` test strings (a third random walks of the automaton, a third those with one
character changed, a third random strings over the pattern's characters and a few others; the reference
is `re`, the walks only make sure that matches are among them).

- dgemma: `Automaton(pattern)`, a Glushkov automaton over characters (a state per character position).
- interegular: `parse_pattern(p).to_fsm()`, a DFA over characters (pure Python).
- outlines-core: `Index(p, Vocabulary)`, a DFA over token ids (Rust), built over the single-character
  tokens that dgemma's string holes use (those of the shipped code model's tokenizer); and, for a few
  patterns, over that tokenizer's whole usable vocabulary, which is what a token-level automaton costs.
  Its states are those its transition table names.

"transitions" counts what each one stores: dgemma's follow edges (each reads a set of characters),
interegular's map entries (one per state and character class), outlines-core's (state, token) entries.
Disagreements are split into missed (matches rejected) and extra (non-matches accepted).

The libraries live outside the project's venv; they are looked up on sys.path first, then in `--libs`:

    python3 -m venv /tmp/rxvenv && /tmp/rxvenv/bin/pip install interegular outlines-core
    .venv/bin/python benchmarks/regex_libraries.py [--libs /tmp/rxvenv/lib/python3.11/site-packages]
        [--strings 500] [--repeats 5] [--seed 0]

Without them it measures the hand-written automaton only. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from importlib import metadata

import dgemma
from dgemma.structured.plans import _classes
from dgemma.structured.regex import REGEX_FORMATS, Automaton
from dgemma.tasks.code import MODEL_DIR

PATTERNS = [
    *((name, pattern) for name, (pattern, _) in REGEX_FORMATS.items()),
    ("code", r"^[A-Z]{2}-\d{4}$"),
    ("slug", r"^[a-z]+(-[a-z]+)*$"),
    ("pets", r"^(cat|dog)s?$"),
    ("no-digits", r"^[^0-9 ]{2,8}$"),
    ("version", r"^v\d+\.\d+(\.\d+)?$"),
    ("label-63", r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"),
]
FULL_VOCAB = ["email", "ipv6", "slug"]  # patterns also indexed over the whole vocabulary
NOISE = " 0aZ-.:@_/"
DEFAULT_LIBS = "/tmp/rxvenv/lib/python3.11/site-packages"


def import_libraries(libs: str):
    """interegular and outlines_core, from sys.path or else from `libs` (None for each one missing)."""
    found = {}
    for name in ("interegular", "outlines_core"):
        try:
            found[name] = __import__(name)
        except ImportError:
            if libs not in sys.path:
                sys.path.append(libs)  # after the project's own packages: nothing of the venv is shadowed
            try:
                found[name] = __import__(name)
            except ImportError:
                found[name] = None
    missing = [n for n, m in found.items() if m is None]
    if missing:
        print(
            f"missing {', '.join(missing)}: `pip install interegular outlines-core` into a venv and pass its "
            f"site-packages with --libs (looked in {libs}); measuring what is there",
            file=sys.stderr,
        )
    return found["interegular"], found["outlines_core"]


def strip_anchors(pattern: str) -> str:
    return pattern.removeprefix("^").removesuffix("$")


def timed(build, repeats: int):
    """The built object and the median milliseconds of `repeats` builds."""
    times, out = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        out = build()
        times.append((time.perf_counter() - t) * 1e3)
    return out, statistics.median(times)


def test_strings(a: Automaton, n: int, rng: random.Random) -> list[str]:
    """Walks of `a`, the walks with one character changed, and random strings (see the module docstring)."""
    alphabet = sorted(set().union(*a.chars) | set(NOISE))

    def walk() -> str:
        p, text = a.start, ""
        while a.follow[p] and len(text) < 80 and not (p in a.last and rng.random() < 0.25):
            q = rng.choice(sorted(a.follow[p]))
            text, p = text + rng.choice(sorted(a.chars[q])), q
        return text

    walks = [walk() for _ in range(n // 3)]
    changed = []
    for w in walks:
        i, ch = rng.randrange(len(w) + 1), rng.choice(alphabet)
        how = rng.choice(("insert", "delete", "replace"))
        changed.append(
            w[:i] + ch + w[i:]
            if how == "insert" or not w[i:]
            else w[:i] + (ch if how == "replace" else "") + w[i + 1 :]
        )
    longest = max(len(w) for w in walks) + 2
    rand = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, longest))) for _ in range(n - 2 * len(walks))]
    return walks + changed + rand


def index_states(index) -> tuple[int, int]:
    """An outlines-core Index's states (those its transitions name) and transitions."""
    table = index.get_transitions()
    states = set(table) | {s for row in table.values() for s in row.values()}
    return len(states), sum(len(row) for row in table.values())


def index_accepts(index, ids: dict[str, int], text: str) -> bool:
    state = index.get_initial_state()
    for ch in text:
        state = index.get_next_state(state, ids[ch]) if ch in ids else None
        if state is None:
            return False
    return index.is_final_state(state)


def measure(label: str, compile_, accepts, size, pattern: str, strings: list[str], repeats: int) -> dict:
    """One implementation on one pattern: as given, else without its anchors."""
    row = {"impl": label, "compiles": True, "error": None, "stripped": False}
    for attempt in (pattern, strip_anchors(pattern)):
        try:
            built, ms = timed(lambda p=attempt: compile_(p), repeats)
            break
        except Exception as e:  # a refusal is a result
            if row["compiles"]:
                row.update(compiles=False, error=f"{type(e).__name__}: {e}")
            if attempt == strip_anchors(pattern):
                return {
                    **row,
                    "ms": None,
                    "states": None,
                    "transitions": None,
                    "disagree": None,
                    "missed": None,
                    "extra": None,
                }
            row["stripped"] = True
    states, transitions = size(built)
    said = [(accepts(built, s), bool(re.fullmatch(pattern, s))) for s in strings]
    missed, extra = sum(m and not a for a, m in said), sum(a and not m for a, m in said)
    return {
        **row,
        "ms": ms,
        "states": states,
        "transitions": transitions,
        "disagree": missed + extra,
        "missed": missed,
        "extra": extra,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--libs", default=DEFAULT_LIBS, help="site-packages holding interegular and outlines_core")
    ap.add_argument("--strings", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    interegular, outlines_core = import_libraries(args.libs)

    tok = dgemma.Tokenizer.from_dir(MODEL_DIR)
    vocab_size = dgemma.load(MODEL_DIR, dtype="fp32").text_config.vocab_size
    classes = _classes(tok, vocab_size)
    single = classes.single_chars
    eos = tok.token_to_id(tok.special_tokens["eos_token"])

    impls = [
        (
            "dgemma",
            Automaton,
            lambda a, s: a.matches(s),
            lambda a: (len(a.chars), sum(map(len, a.follow))),
        )
    ]
    if interegular is not None:
        impls.append(
            (
                "interegular",
                lambda p: interegular.parse_pattern(p).to_fsm(),
                lambda f, s: f.accepts(s),
                lambda f: (len(f.states), sum(len(row) for row in f.map.values())),
            )
        )
    if outlines_core is not None:
        chars_vocab = outlines_core.Vocabulary(eos, {ch: [t] for ch, t in single.items()})
        impls.append(
            (
                "outlines-core",
                lambda p: outlines_core.Index(p, chars_vocab),
                lambda index, s: index_accepts(index, single, s),
                index_states,
            )
        )

    rng = random.Random(args.seed)
    results = []
    for name, pattern in PATTERNS:
        strings = test_strings(Automaton(pattern), args.strings, rng)
        matching = sum(bool(re.fullmatch(pattern, s)) for s in strings)
        for label, compile_, accepts, size in impls:
            row = measure(label, compile_, accepts, size, pattern, strings, args.repeats)
            results.append({"pattern": name, "regex": pattern, "strings": len(strings), "matching": matching, **row})

    full = []
    if outlines_core is not None:
        texts: dict[str, list[int]] = {}
        for i, t in enumerate(classes.texts):
            if classes.usable(i):
                texts.setdefault(t, []).append(i)
        vocab = outlines_core.Vocabulary(eos, texts)
        for name in FULL_VOCAB:
            pattern = strip_anchors(dict(PATTERNS)[name])
            index, ms = timed(lambda p=pattern: outlines_core.Index(p, vocab), max(1, args.repeats // 2))
            states, transitions = index_states(index)
            full.append({"pattern": name, "regex": pattern, "ms": ms, "states": states, "transitions": transitions})

    def cell(value, fmt="{}"):
        return "-" if value is None else fmt.format(value)

    print(f"vocabulary: {vocab_size} ids, {len(single)} single-character tokens; {args.strings} strings per pattern\n")
    header = ["pattern", "implementation", "compiles as given", "compile ms", "states", "transitions"]
    print("| " + " | ".join([*header, "disagreements (missed / extra)"]) + " |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        given = "yes" if r["compiles"] else f"no ({r['error']})" + ("; stripped ^$" if r["stripped"] else "")
        disagree = "-" if r["disagree"] is None else f"{r['disagree']}/{r['strings']} ({r['missed']} / {r['extra']})"
        row = [
            r["pattern"],
            r["impl"],
            given,
            cell(r["ms"], "{:.2f}"),
            cell(r["states"]),
            cell(r["transitions"]),
            disagree,
        ]
        print("| " + " | ".join(row) + " |")
    if full:
        print(
            f"\noutlines-core Index over the whole usable vocabulary ({sum(len(v) for v in texts.values())} tokens):\n"
        )
        print("| pattern | compile ms | states | transitions |")
        print("|---|---|---|---|")
        for r in full:
            print(f"| {r['pattern']} | {r['ms']:.1f} | {r['states']} | {r['transitions']} |")
    summary = {
        "vocab_size": vocab_size,
        "single_chars": len(single),
        "libraries": {
            "interegular": metadata.version("interegular") if interegular else None,
            "outlines-core": metadata.version("outlines-core") if outlines_core else None,
        },
        "results": results,
        "full_vocabulary": full,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
