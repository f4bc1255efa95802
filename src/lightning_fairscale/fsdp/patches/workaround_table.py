"""The record of one workaround of :mod:`~lightning_fairscale.fsdp.patches.workarounds`, and the table of them as
reStructuredText."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Workaround", "list_table"]


@dataclass(frozen=True)
class Workaround:
    """One FairScale workaround: a row of the table."""

    #: Its number (1, 2, ...), which the code's comments and the tests' markers name.
    number: int
    #: What it is about, in a few words.
    title: str
    #: Where it applies: ``"all devices"``, ``"CPU"``, ``"sharded DDP, all devices"``...
    devices: str
    #: What FairScale does, and why that is wrong here (reStructuredText).
    fairscale_does: str
    #: What we do instead: the override or function, and how (reStructuredText).
    our_fix: str
    #: The module that holds the fix, under ``lightning_fairscale`` (``"fsdp.patches.cpu_streams"``).
    module: str
    #: The tests marked with its number (``"tests/unit/test_x.py::test_y"``): they fail without it.
    tests: tuple[str, ...]


def _cell(text: str, first: str) -> str:
    """One cell of a list-table row: ``first`` (``"* - "`` or ``"  - "``) then ``text``, wrapped and indented."""
    lines = textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False) or [""]
    return "\n".join([f"   {first}{lines[0]}", *(f"       {line}" for line in lines[1:])])


def list_table(workarounds: Sequence[Workaround]) -> str:
    """The workarounds as a reStructuredText ``list-table``: number, title and devices, what FairScale does, our
    fix, module and tests."""
    header = ("No.", "Workaround", "What FairScale does", "Our fix", "Module; tests")
    rows = [".. list-table::", "   :header-rows: 1", "   :widths: 3 12 30 35 20", ""]
    rows += [_cell(text, "  - " if i else "* - ") for i, text in enumerate(header)]
    for w in workarounds:
        files: dict[str, list[str]] = {}
        for test in w.tests:
            path, name = test.split("::")
            files.setdefault(path, []).append(f"``{name}``")
        tests = "; ".join(f"{path}: {', '.join(names)}" for path, names in files.items())
        rows += [
            _cell(str(w.number), "* - "),
            _cell(f"{w.title} *({w.devices})*", "  - "),
            _cell(w.fairscale_does, "  - "),
            _cell(w.our_fix, "  - "),
            _cell(f":mod:`{w.module} <lightning_fairscale.{w.module}>`. Tests: {tests}", "  - "),
        ]
    return "\n".join(rows) + "\n"
