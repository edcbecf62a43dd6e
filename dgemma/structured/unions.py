"""Choosing a union's branch by the model's scores where no draft chose it (`size="schema"`, or a draft
value that fits no branch): each open union is asked as a Score call of its branches' first tokens.

A union's place in the tree is a path: property keys, item indexes and branch indexes from the root.
`apply` sets the branches chosen so far and returns the unions still open whose enclosing unions are all
chosen (a nested one is asked once the branch holding it is known, so its context is right). The context
is the answer before the union written with the shortest valid values (the holes before it are not
filled yet), and each branch is its shortest value cut after its first token that no other branch shares
at the same place: what the scores compare is where the branches part.
"""

from __future__ import annotations

from typing import Any

from .nodes import _Array, _Object, _Union
from .tokens import Syntax

Path = tuple[Any, ...]


def apply(node: Any, branches: dict[Path, int], path: Path = ()) -> list[tuple[Path, _Union]]:
    """Set each union at a path in `branches` that its draft left open to that branch; the open unions
    left, outermost first (not those inside another open one)."""
    if isinstance(node, _Union):
        if not node.decided and path in branches:
            node.chosen, node.decided = branches[path], True
        if not node.decided:
            return [(path, node)]
        return apply(node.branches[node.chosen], branches, (*path, node.chosen))
    if isinstance(node, _Object):
        return [u for key, n in node.properties for u in apply(n, branches, (*path, key))]
    if isinstance(node, _Array):
        return [u for i, n in enumerate(node.items) for u in apply(n, branches, (*path, i))]
    return []


def written(node: Any, syntax: Syntax, target: Path | None = None, path: Path = ()) -> tuple[str, bool]:
    """The text of `node`'s shortest value as its template writes it (its chosen branches, keys in the
    syntax's order), up to the value at `target` when that is inside it (then True)."""
    if path == target:
        return "", True
    if isinstance(node, _Union):
        return written(node.branches[node.chosen], syntax, target, (*path, node.chosen))
    if isinstance(node, _Object):
        out = "{"
        ordered = sorted(node.properties, key=lambda p: p[0]) if syntax.sort_keys else node.properties
        for i, (key, n) in enumerate(ordered):
            text, found = written(n, syntax, target, (*path, key))
            out += ("," if i else "") + syntax.key(key) + text
            if found:
                return out, True
        return out + "}", False
    if isinstance(node, _Array):
        out, whole = "[", ""
        for i, n in enumerate(node.items):
            text, found = written(n, syntax, target, (*path, i))
            out += ("," if i else "") + text
            if found:
                return out, True
            whole = out if i + 1 == node.min_items else whole
        return (whole or "[") + "]", False
    return syntax.write(node.shortest()), False


def parting(options: list[list[int]]) -> list[list[int]]:
    """Each option's tokens up to and including its first token that some other option does not have at
    the same place (all of it when another option starts with it)."""

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    cuts = [max((common(a, b) for j, b in enumerate(options) if j != i), default=0) for i, a in enumerate(options)]
    return [a[: min(len(a), cut + 1)] for a, cut in zip(options, cuts, strict=True)]
