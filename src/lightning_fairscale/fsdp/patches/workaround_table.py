"""The table of :mod:`~lightning_fairscale.fsdp.patches.workarounds` as reStructuredText (its records, rendered)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

__all__ = ["list_table"]


def _cell(text: str, first: str) -> str:
    """One cell of a list-table row: ``first`` (``"* - "`` or ``"  - "``) then ``text``, wrapped and indented."""
    lines = textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False) or [""]
    return "\n".join([f"   {first}{lines[0]}", *(f"       {line}" for line in lines[1:])])


def list_table(workarounds: Sequence[Any]) -> str:
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
