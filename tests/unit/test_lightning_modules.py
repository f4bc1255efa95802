"""``lightning_fairscale.lightning``'s modules: the copies that ``make lightning`` (``tools/generate_lightning.py``)
writes of every module that imports Lightning, with the imports renamed for the unified ``lightning`` package.

Read from the files: no Lightning import here.
"""

from __future__ import annotations

import doctest
import re
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPOSITORY / "tools"))

import generate_lightning as generator  # noqa: E402

SOURCE = REPOSITORY / "src" / "lightning_fairscale"
COPIES = SOURCE / "lightning"


def test_the_copies_are_what_make_lightning_writes_now() -> None:
    """Fails after a change to a Lightning-bound module (or a merge) until ``make lightning`` has run."""
    outdated = generator.stale(generator.generated())
    assert not outdated, f"out of date: {outdated}; run `make lightning`"


def test_the_copies_folder_holds_only_copies_and_the_handwritten_init() -> None:
    """A file edited by hand (its header gone) or added by hand would not be rewritten by ``make lightning``."""
    copies = set(generator.generated())
    others = sorted(str(p.relative_to(SOURCE)) for p in COPIES.rglob("*.py") if p not in copies)
    assert others == ["lightning/__init__.py"], (
        f"{others}: not written by `make lightning`; move the code to the source"
    )


def _imports_lightning(path: Path) -> bool:
    """Whether the file has an import statement of a standalone Lightning package (a scan by lines, independent of the
    generator's AST walk)."""
    pattern = re.compile(r"^\s*(from|import)\s+(pytorch_lightning|lightning_fabric)\b", re.MULTILINE)
    return bool(pattern.search(path.read_text()))


def test_every_module_that_imports_lightning_has_its_copy() -> None:
    sources = [p for p in SOURCE.rglob("*.py") if COPIES not in p.parents and p != SOURCE / "__init__.py"]
    importing = [p.relative_to(SOURCE) for p in sources if _imports_lightning(p)]
    assert len(importing) >= 10  # the scan found the adapters at all
    missing = [str(p) for p in importing if not (COPIES / p).is_file()]
    assert not missing, f"these modules import Lightning but have no copy: {missing}; run `make lightning`"


def test_every_copy_needs_lightning() -> None:
    """A copy imports Lightning, imports another copy, or is the package of one: shared modules are not copied."""
    for path in set(generator.generated()):
        text = path.read_text()
        needs = "lightning.pytorch" in text or "lightning.fabric" in text or "lightning_fairscale.lightning." in text
        is_package_of_one = path.name == "__init__.py" and len(list(path.parent.glob("*.py"))) > 1
        assert needs or is_package_of_one, path


def test_a_copy_keeps_its_sources_lines_but_the_imports() -> None:
    """Line n + 1 of a copy is line n of its source (tracebacks stay next to the source), the header names the source
    and the command, and only import lines differ."""
    for path, text in generator.generated().items():
        source = SOURCE / path.relative_to(COPIES)
        header, *lines = text.splitlines()
        name = source.relative_to(SOURCE).as_posix()
        assert header == f"# Generated from lightning_fairscale/{name} by `make lightning`: do not edit."
        original = source.read_text().splitlines()
        assert len(lines) == len(original), path
        changed = [(a, b) for a, b in zip(original, lines) if a != b]
        assert all(re.match(r"\s*(from|import) ", a) for a, _ in changed), changed
    fully_sharded = COPIES / "strategies" / "fully_sharded.py"
    assert "from lightning.pytorch.strategies import DDPStrategy" in fully_sharded.read_text()


@pytest.mark.parametrize(
    ("source", "renamed"),
    [
        ("import pytorch_lightning as pl", "import lightning.pytorch as pl"),
        ("import pytorch_lightning", "import lightning.pytorch as pytorch_lightning"),
        ("from lightning_fabric.plugins import CheckpointIO", "from lightning.fabric.plugins import CheckpointIO"),
        ("from lightning_fairscale.precision import X", "from lightning_fairscale.lightning.precision import X"),
        ("from lightning_fairscale.fsdp.policies import X", "from lightning_fairscale.fsdp.policies import X"),
        ("from lightning_fairscale.fsdp import units", "from lightning_fairscale.fsdp import units"),
        ("import torch.distributed as dist", "import torch.distributed as dist"),
        # In place: comments, parentheses, indentation and other lines stay as they are.
        (
            "from  pytorch_lightning import (  # why\n    Trainer,\n)",
            "from  lightning.pytorch import (  # why\n    Trainer,\n)",
        ),
        (
            "def f():\n    from lightning_fabric import Fabric  # lazy",
            "def f():\n    from lightning.fabric import Fabric  # lazy",
        ),
        ("import os, pytorch_lightning as pl", "import os, lightning.pytorch as pl"),
        ("x = 'pytorch_lightning'  # only imports", "x = 'pytorch_lightning'  # only imports"),
    ],
)
def test_imports_are_renamed_in_place(source: str, renamed: str) -> None:
    assert generator.rename_imports(source, "x.py", ("precision",)) == renamed


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("from .fully_sharded import X", "relative imports"),
        ("import pytorch_lightning.strategies", "cannot be renamed"),
        ("from lightning_fairscale import precision", "by their full name"),
        ("from lightning_fairscale.precision import shared", "both packages share"),
    ],
)
def test_imports_that_cannot_be_renamed_are_refused(source: str, match: str) -> None:
    with pytest.raises(generator.GenerationError, match=match):
        generator.rename_imports(source, "x.py", ("precision",), ("precision", "precision.shared"))


def test_the_generators_examples() -> None:
    assert doctest.testmod(generator).failed == 0


def _package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_make_lightning_writes_new_copies_and_removes_those_of_modules_that_are_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "src" / "lightning_fairscale"
    _package(source, {
        "__init__.py": "from lightning_fairscale.strategies import S\n",  # the hand-written twin stands for it
        "fsdp/__init__.py": "",
        "fsdp/units.py": "import torch\n",  # shared
        "strategies/__init__.py": "from lightning_fairscale.strategies.s import S\n",  # imports a bound module
        "strategies/s.py": (
            "from pytorch_lightning.strategies import DDPStrategy\nimport lightning_fairscale.fsdp.units as units\n"
        ),
        "strategies/helpers.py": "import os\n",  # shared, though in a bound package
        "lightning/__init__.py": "# hand-written\n",
        "lightning/old.py": "# Generated from lightning_fairscale/old.py by `make lightning`: do not edit.\n",
        "lightning/notes.py": "# mine\n",
    })  # fmt: skip
    for name, value in {"REPOSITORY": tmp_path, "SOURCE_ROOT": source, "TARGET_ROOT": source / "lightning"}.items():
        monkeypatch.setattr(generator, name, value)
    assert generator.main(["--check"]) == 1
    assert generator.main([]) == 0
    assert generator.main(["--check"]) == 0
    written = {p.relative_to(source).as_posix() for p in (source / "lightning").rglob("*.py")}
    assert written == {"lightning/__init__.py", "lightning/notes.py", "lightning/strategies/__init__.py",
                       "lightning/strategies/s.py"}  # fmt: skip
    assert (source / "lightning/strategies/s.py").read_text() == (
        "# Generated from lightning_fairscale/strategies/s.py by `make lightning`: do not edit.\n"
        "from lightning.pytorch.strategies import DDPStrategy\nimport lightning_fairscale.fsdp.units as units\n"
    )
    init = (source / "lightning/strategies/__init__.py").read_text()
    assert "lightning_fairscale.lightning.strategies.s import S" in init
