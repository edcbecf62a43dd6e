"""Regular expressions (a `pattern`, and the formats email, hostname, ipv4, ipv6) as position automata over
characters, and a string hole laid out and read back by one: valid by construction (docs/structured.md).

Each position of the hole holds one single-character token (or, past the shortest match, the closing
quote); its allowed characters are those some match of the allowed lengths can hold there. The fill is
read back as it is when it matches; otherwise as the best matching string under the fill's own scores
(a best path over the hole's positions and the automaton's states, as DINGO does), which always exists.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Iterable
from re import _parser  # the regular-expression parser of the standard library
from typing import Any

import torch

from .nodes import MORE, _Layout, _Read
from .tokens import StructuredOutputError, Syntax, TokenClasses, check_deadline

PRINTABLE = "".join(chr(i) for i in range(0x20, 0x7F) if chr(i) not in '"\\')  # a string's own characters
MAX_PATTERN_CHARS = 128  # the longest string a pattern hole holds (a token per character)
DEFAULT_PATTERN_CHARS = 32  # a pattern hole's length when neither the pattern nor maxLength bounds it
MAX_STATES = 2048  # the automaton's character positions, repetitions written out
MAX_EDGES = 65536  # its follow edges ((a?){2000} has two million): what a layout and a read walk
MAX_CLASS_CHARS = 1024
_LABEL = r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?"
_BYTE = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
# each a subset of its format that its checkers accept whole (email-validator, as Pydantic's EmailStr uses
# it: top-level domains of 2-3 letters, none of them special-use; fqdn; ipaddress), and its longest string
REGEX_FORMATS = {
    "email": (r"[a-z0-9]+([._+-][a-z0-9]+)*@[a-z0-9]+(-[a-z0-9]+)*(\.[a-z0-9]+(-[a-z0-9]+)*)*\.[a-z]{2,3}", 48),
    "hostname": (rf"{_LABEL}(\.{_LABEL})*", 48),
    "ipv4": (rf"({_BYTE}\.){{3}}{_BYTE}", 15),
    "ipv6": (r"[0-9a-f]{1,4}(:[0-9a-f]{1,4}){7}", 39),
}
_CATEGORIES = {
    _parser.CATEGORY_DIGIT: string.digits,
    _parser.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    _parser.CATEGORY_SPACE: " ",
}
_NOT = {
    _parser.CATEGORY_NOT_DIGIT: _parser.CATEGORY_DIGIT,
    _parser.CATEGORY_NOT_WORD: _parser.CATEGORY_WORD,
    _parser.CATEGORY_NOT_SPACE: _parser.CATEGORY_SPACE,
}


class Automaton:
    """The position (Glushkov) automaton of a regular expression: a state per character position of the
    expression, with the characters it reads and the states that may follow it. State `start` reads
    nothing; a string matches when a path from it reads the string and stops in `last`."""

    def __init__(self, pattern: str):
        self.pattern = pattern
        self.chars: list[frozenset[str]] = []
        self.follow: list[set[int]] = []
        self.edges = 0
        self.layouts: dict[tuple, tuple] = {}  # an unsized hole's (states, ends, masks) per bounds and classes
        try:
            parsed = _parser.parse(pattern)
        except re.error as e:
            raise StructuredOutputError(f"pattern {pattern!r} is not a regular expression: {e}") from None
        if parsed.state.flags & ~(re.UNICODE | re.ASCII):
            raise StructuredOutputError(f"pattern {pattern!r}: inline flags are not supported")
        nullable, first, last = self._sequence(_unanchored(list(parsed)))
        self.start = self._state(frozenset())
        self.follow[self.start] = set(first)
        self.last = set(last) | ({self.start} if nullable else set())

    def matches(self, text: str) -> bool:
        states = {self.start}
        for ch in text:
            states = self.step(states, ch)
            if not states:
                return False
        return bool(states & self.last)

    def step(self, states: set[int], ch: str) -> set[int]:
        """The states after reading `ch` from any of `states`."""
        return {q for p in states for q in self.follow[p] if ch in self.chars[q]}

    def longest(self, limit: int) -> int:
        """The length of the longest match up to `limit` (`limit` when matches go on past it), -1: none."""
        states, longest = {self.start}, -1
        for n in range(limit + 1):
            if states & self.last:
                longest = n
            if not states:
                break
            states = {q for p in states for q in self.follow[p]}
        return limit if states else longest

    # building: each part of the expression gives (nullable, first states, last states)

    def _state(self, chars: frozenset[str]) -> int:
        check_deadline()
        if len(self.chars) >= MAX_STATES:
            raise StructuredOutputError(f"pattern {self.pattern!r} writes out to more than {MAX_STATES} characters")
        self.chars.append(chars)
        self.follow.append(set())
        return len(self.chars) - 1

    def _link(self, states: set[int], following: set[int]) -> None:
        """Each of `states` may be followed by each of `following`."""
        self.edges += len(states) * len(following)
        if self.edges > MAX_EDGES:
            raise StructuredOutputError(f"pattern {self.pattern!r} has more than {MAX_EDGES} transitions")
        for p in states:
            self.follow[p] |= following

    def _join(self, parts: Iterable[tuple[bool, set[int], set[int]]]) -> tuple[bool, set[int], set[int]]:
        """Parts one after the other."""
        nullable, first, last = True, set(), set()
        for n, f, lst in parts:
            self._link(last, f)
            first = first | f if nullable else first
            last = last | lst if n else set(lst)
            nullable = nullable and n
        return nullable, first, last

    def _sequence(self, items: list) -> tuple[bool, set[int], set[int]]:
        return self._join(self._item(op, arg) for op, arg in items)

    def _item(self, op, arg) -> tuple[bool, set[int], set[int]]:
        if op is _parser.AT:  # `_unanchored` took those at the ends: one inside cannot be honoured
            where = str(arg).lower().removeprefix("at_")
            raise StructuredOutputError(f"pattern {self.pattern!r}: an anchor ({where}) is supported only at its ends")
        if op in (_parser.LITERAL, _parser.NOT_LITERAL, _parser.ANY, _parser.IN):
            q = self._state(frozenset(self._chars(op, arg)))
            return False, {q}, {q}
        if op is _parser.SUBPATTERN:
            if arg[1] or arg[2]:
                raise StructuredOutputError(f"pattern {self.pattern!r}: inline flags are not supported")
            return self._sequence(list(arg[3]))
        if op is _parser.BRANCH:
            branches = [self._sequence(list(b)) for b in arg[1]]
            firsts, lasts = (set().union(*(b[i] for b in branches)) for i in (1, 2))
            return any(b[0] for b in branches), firsts, lasts
        if op in (_parser.MAX_REPEAT, _parser.MIN_REPEAT, _parser.POSSESSIVE_REPEAT):
            return self._repeat(*arg)
        raise StructuredOutputError(f"pattern {self.pattern!r}: {str(op).lower()} is not supported")

    def _repeat(self, low: int, high: int, items) -> tuple[bool, set[int], set[int]]:
        parts = [self._sequence(list(items)) for _ in range(low)]
        if high is _parser.MAXREPEAT:  # a loop: the last states lead back to the first
            _, f, lst = self._sequence(list(items))
            self._link(lst, f)
            return self._join([*parts, (True, f, lst)])
        optional = None  # x{0,k} as x(x(x)?)?: each copy may end the repetition
        for _ in range(high - low):
            copy = self._sequence(list(items))
            optional = (True, *self._join([copy, optional])[1:]) if optional else (True, copy[1], copy[2])
        return self._join(parts + ([optional] if optional else []))

    def _chars(self, op, arg) -> str:
        if op is _parser.LITERAL:
            chars = chr(arg)
        elif op is _parser.ANY:
            chars = PRINTABLE
        elif op is _parser.NOT_LITERAL:
            chars = PRINTABLE.replace(chr(arg), "")
        else:
            chars = self._class(arg)
        kept = "".join(sorted({ch for ch in chars if ch in PRINTABLE or ord(ch) > 0x7F}))
        if not kept:
            raise StructuredOutputError(f"pattern {self.pattern!r} needs a character a string escapes ({chars!r})")
        return kept

    def _class(self, members: list) -> str:
        negate = bool(members) and members[0][0] is _parser.NEGATE
        out = ""
        for op, arg in members[negate:]:
            if op is _parser.LITERAL:
                out += chr(arg)
            elif op is _parser.RANGE and arg[1] - arg[0] < MAX_CLASS_CHARS:
                out += "".join(chr(i) for i in range(arg[0], arg[1] + 1))
            elif op is _parser.CATEGORY and arg in _CATEGORIES:
                out += _CATEGORIES[arg]
            elif op is _parser.CATEGORY and arg in _NOT:
                out += "".join(ch for ch in PRINTABLE if ch not in _CATEGORIES[_NOT[arg]])
            else:
                raise StructuredOutputError(f"pattern {self.pattern!r}: the class member {op} {arg} is not supported")
        return "".join(ch for ch in PRINTABLE if ch not in out) if negate else out


_BEGIN, _END = {_parser.AT_BEGINNING, _parser.AT_BEGINNING_STRING}, {_parser.AT_END, _parser.AT_END_STRING}


def _unanchored(items: list) -> list:
    """The parsed pattern without the `^` / `\\A` it starts with and the `$` / `\\Z` it ends with (each
    branch of a pattern that is one alternation too): the answer is the whole string, so those hold."""
    while items and items[0][0] is _parser.AT and items[0][1] in _BEGIN:
        items = items[1:]
    while items and items[-1][0] is _parser.AT and items[-1][1] in _END:
        items = items[:-1]
    if len(items) == 1 and items[0][0] is _parser.BRANCH:
        return [(_parser.BRANCH, (None, [_unanchored(list(b)) for b in items[0][1][1]]))]
    return items


class _Regex:
    """A string that matches `automaton`, of `min_length` to `max_length` characters, a single-character
    token per position (see the module docstring). Sized by a drafted string that matches, the hole
    has its length and the closing quote is pinned after it."""

    def __init__(self, a: Automaton, min_length: int, max_length: int):
        self.a, self.min_length, self.max_length = a, min_length, max_length
        self.length: int | None = None  # sized: exactly this many characters

    def size(self, value: Any, c: TokenClasses, syntax: Syntax) -> None:
        fits = isinstance(value, str) and self.min_length <= len(value) <= self.max_length
        if fits and self.a.matches(value) and all(ch in _writable(c, syntax) for ch in value):
            self.length = len(value)

    def accepts(self, value: Any) -> bool:
        fits = isinstance(value, str) and self.min_length <= len(value) <= self.max_length
        return fits and self.a.matches(value)

    def shortest(self) -> str:
        """The shortest match (of the smallest characters), at least `min_length` long."""
        a = self.a
        layer = {(a.start, 0): ""}
        seen = set(layer)
        for _ in range(self.max_length + 1):
            done = [text for (p, n), text in layer.items() if p in a.last and n >= self.min_length]
            if done:
                return min(done)
            following: dict[tuple[int, int], str] = {}
            for (p, n), text in layer.items():
                for q in a.follow[p]:
                    key, longer = (q, min(n + 1, self.min_length)), text + min(a.chars[q])
                    if key not in seen and (key not in following or longer < following[key]):
                        following[key] = longer
            seen |= set(following)
            layer = following
        return "a" * self.min_length  # none within the bounds: the layout refuses the schema

    # the positions' states: forward from the start, kept only where a match of an allowed length goes on

    def _states(self, writable: dict[str, int]) -> list[set[int]]:
        """Per count k of characters written (0..n), the states a match can be in there."""
        n, a = self.length if self.length is not None else self.max_length, self.a
        usable = [any(ch in writable for ch in chars) for chars in a.chars]
        ends = [k for k in range(n + 1) if (k == n if self.length is not None else k >= self.min_length)]
        alive = [set() for _ in range(n + 1)]  # states from which the rest can be written
        for k in range(n, -1, -1):
            check_deadline()
            alive[k] = {p for p in range(len(a.chars)) if p in a.last and k in ends}
            if k < n:
                alive[k] |= {p for p in range(len(a.chars)) if a.follow[p] & alive[k + 1]}
            alive[k] = {p for p in alive[k] if usable[p] or p == a.start}
        states = [{a.start} & alive[0]]
        for k in range(n):
            states.append({q for p in states[k] for q in a.follow[p]} & alive[k + 1])
        if not states[0]:
            raise StructuredOutputError(
                f"pattern {a.pattern!r} has no match of {self.min_length} to {n} characters this tokenizer can write"
            )
        self.ends = [k for k in ends if states[k] & a.last]
        return states

    def layout(self, b: _Layout) -> None:
        c, quote = b.classes, b.syntax.string_open
        self.close, self.writable = c.string(b.syntax)[1], _writable(c, b.syntax)
        key = (self.min_length, self.max_length, c, b.syntax.name)
        if self.length is not None:  # sized by a draft: a length of its own, not kept
            self.states, self.ends, masks = self._masks(c)
        else:  # the schema's layout, kept: the automaton is shared by every schema with its pattern
            if key not in self.a.layouts:
                self.a.layouts[key] = self._masks(c)
            self.states, self.ends, masks = self.a.layouts[key]
        b.scored = True
        b.text(quote)
        self.span = b.hole(masks, None if self.length is not None else self.close)
        b.text(quote)

    def _masks(self, c: TokenClasses) -> tuple[list[set[int]], list[int], list[torch.Tensor]]:
        """Per position, the states a match can be in, the lengths a match may end at, and the tokens
        a position may hold."""
        states = self._states(self.writable)
        masks, cache = [], {}
        for k in range(len(states) - 1):
            chars = frozenset(ch for q in states[k + 1] for ch in self.a.chars[q] if ch in self.writable)
            ends = self.length is None and bool(self.ends) and k >= self.ends[0]
            if (chars, ends) not in cache:
                mask = self.close.clone() if ends else torch.zeros(c.vocab_size, dtype=torch.bool)
                mask[[self.writable[ch] for ch in chars]] = True
                cache[chars, ends] = mask
            masks.append(cache[chars, ends])
        return states, self.ends, masks

    def read(self, r: _Read) -> str:
        tokens = r.tokens[self.span]
        text = r.text(self.span, None if self.length is not None else self.close)
        whole = len(text) == len(tokens) if self.length is not None else len(text) in self.ends
        if whole and self.a.matches(text) and all(len(r.classes.texts[t]) == 1 for t in tokens[: len(text)]):
            return text
        return self._best(r, tokens)

    def _best(self, r: _Read, tokens: list[int]) -> str:
        """The match with the highest score: per position, the fill's log-probability of a character
        where the reader has it, else one below the lowest it has (without scores: 0 for the filled
        character, -1 for any other)."""
        c, a = r.classes, self.a
        scores = []  # per position: {character or None (the closing quote): score}, and the floor
        for k, t in enumerate(tokens):
            known = r.alternatives(self.span.start + k) or {t: 0.0}
            chars = {(None if bool(self.close[i]) else c.texts[i]): v for i, v in known.items()}
            scores.append((sorted(chars.items(), key=lambda kv: -kv[1]), min(known.values()) - 1.0))
        best = {a.start: (0.0, "")}
        finished = []  # (score, text) of matches that end before the hole does
        for k, (ranked, floor) in enumerate(scores):
            if self.length is None and k in self.ends:
                rest = sum(s[0][0][1] if s[0] else s[1] for s in scores[k + 1 :])
                close = next((v for ch, v in ranked if ch is None), floor)
                finished += [(v + close + rest, text) for p, (v, text) in best.items() if p in a.last]
            step = {}
            for p, (v, text) in best.items():
                for q in a.follow[p] & self.states[k + 1]:
                    ch, e = next(((ch, e) for ch, e in ranked if ch in a.chars[q]), (None, floor))
                    ch = ch or min(x for x in a.chars[q] if x in self.writable)
                    if q not in step or v + e > step[q][0]:
                        step[q] = (v + e, text + ch)
            best = step
        finished += [(v, text) for p, (v, text) in best.items() if p in a.last and len(text) in self.ends]
        return max(finished, key=lambda f: f[0])[1]

    def scan(self, text: str, i: int):
        """The AR grammar: a quoted string the automaton matches."""
        if i == len(text):
            yield MORE
            return
        if text[i] != '"':
            return
        states, j = {self.a.start}, i + 1
        while j < len(text) and text[j] != '"':
            states = self.a.step(states, text[j])
            if not states or j - i > self.max_length:
                return
            j += 1
        if j == len(text):
            yield MORE
        elif states & self.a.last and self.min_length <= j - i - 1:
            yield j + 1


def _writable(c: TokenClasses, syntax: Syntax) -> dict[str, int]:
    """The characters a string hole can hold, each with its single-character token."""
    close = c.string(syntax)[1]
    return {ch: t for ch, t in c.single_chars.items() if not bool(close[t])}


@functools.lru_cache(maxsize=64)
def _automaton(pattern: str) -> Automaton:
    """One automaton per pattern (it and its layouts are shared: what repeats across requests and fields)."""
    return Automaton(pattern)


def regex_string(pattern: str, min_length: int, max_length: int | None) -> _Regex:
    """A hole for strings that match `pattern` whole, of `min_length` to `max_length` characters (at most
    MAX_PATTERN_CHARS; without a bound, as many as the longest match takes, or DEFAULT_PATTERN_CHARS, or
    the shortest match, when matches can be longer than MAX_PATTERN_CHARS)."""
    a = _automaton(pattern)
    if max_length is None:
        longest = a.longest(MAX_PATTERN_CHARS + 1)
        shortest = len(_Regex(a, min_length, MAX_PATTERN_CHARS).shortest())
        max_length = longest if longest <= MAX_PATTERN_CHARS else max(DEFAULT_PATTERN_CHARS, shortest)
    return _Regex(a, min_length, min(max_length, MAX_PATTERN_CHARS))
