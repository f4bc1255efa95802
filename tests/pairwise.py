"""A small pairwise (all-pairs) generator: rows that together hold every pair of levels of every two factors.

Testing every combination of 12 factors of 2 to 5 levels would take tens of thousands of runs; most feature
interactions that break involve two features, and every pair of levels is covered by a few dozen rows. The
generator is greedy and deterministic (AETG's idea): each new row starts from an uncovered pair and fills the other
factors one at a time with the level that covers the most pairs still missing, skipping levels a constraint forbids.

Constraints come as a function ``allowed(row) -> bool`` over a partial row (a dict of the factors chosen so far) and
``applies(row) -> dict``, which drops from a complete row the factors that mean nothing in it (the wrap policy of a
strategy that does not wrap): a pair counts as covered only by rows in which both of its factors apply.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Row = dict[str, Any]
Pair = tuple[tuple[str, Any], tuple[str, Any]]


def pairs_of(row: Mapping[str, Any]) -> set[Pair]:
    """Every pair of (factor, level) that ``row`` holds, each ordered by factor name."""
    items = sorted(row.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def required_pairs(
    factors: Mapping[str, Sequence[Any]],
    allowed: Callable[[Row], bool],
    applies: Callable[[Row], Row],
) -> set[Pair]:
    """The pairs a covering set must hold: every two levels of two factors that some allowed row applies both of.

    A pair no allowed row can hold (an exclusion) or that only rows which drop one of its factors hold (a level
    that does not apply with another) is not required.
    """
    required: set[Pair] = set()
    for (fa, la_levels), (fb, lb_levels) in itertools.combinations(sorted(factors.items()), 2):
        for la, lb in itertools.product(la_levels, lb_levels):
            row = complete({fa: la, fb: lb}, factors, allowed)
            if row is not None and fa in applies(row) and fb in applies(row):
                required.add(((fa, la), (fb, lb)))
    return required


def complete(seed: Row, factors: Mapping[str, Sequence[Any]], allowed: Callable[[Row], bool]) -> Row | None:
    """Some allowed full row that holds ``seed``, found depth-first in the levels' order; ``None`` if none is."""
    if not allowed(seed):
        return None
    missing = [name for name in factors if name not in seed]
    if not missing:
        return dict(seed)
    name = missing[0]
    for level in factors[name]:
        row = complete({**seed, name: level}, factors, allowed)
        if row is not None:
            return row
    return None


def generate(
    factors: Mapping[str, Sequence[Any]],
    allowed: Callable[[Row], bool] = lambda row: True,
    applies: Callable[[Row], Row] = lambda row: row,
    first: Sequence[Row] = (),
) -> list[Row]:
    """Rows (full, allowed) that hold every required pair (:func:`required_pairs`), in a deterministic order,
    after the rows ``first`` (the plainest cell, say), which count towards the coverage."""
    missing = required_pairs(factors, allowed, applies)
    rows: list[Row] = [dict(row) for row in first]
    for row in rows:
        missing -= pairs_of(applies(row))
    while missing:
        (fa, la), (fb, lb) = min(missing, key=repr)  # the first missing pair, in a stable order
        row: Row = {fa: la, fb: lb}
        for name in factors:
            if name in row:
                continue
            best, best_gain = None, -1
            for level in factors[name]:
                candidate = {**row, name: level}
                if complete(candidate, factors, allowed) is None:
                    continue
                gain = len(_pairs_with(name, level, candidate) & missing)
                if gain > best_gain:
                    best, best_gain = level, gain
            assert best is not None, f"no allowed level of {name!r} completes {row}"
            row[name] = best
        ordered = {name: row[name] for name in factors}
        covered = pairs_of(applies(ordered)) & missing
        assert covered, f"row {ordered} covers no missing pair"
        missing -= covered
        rows.append(ordered)
    return rows


def _pairs_with(name: str, level: Any, row: Row) -> set[Pair]:
    return {pair for pair in pairs_of(row) if (name, level) in pair}


def uncovered(rows: Iterable[Row], required: set[Pair], applies: Callable[[Row], Row]) -> set[Pair]:
    """The required pairs that no row (less what does not apply in it) holds."""
    covered: set[Pair] = set()
    for row in rows:
        covered |= pairs_of(applies(row))
    return required - covered
