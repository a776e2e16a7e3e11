"""No import runs back up: the core imports nothing of the drop-in, the Space or the test models, the drop-in
nothing of the Space or the test models, the Space nothing of the test models (the package facade, `__init__.py`,
may reach the drop-in lazily)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_runtime"
ABOVE_CORE = ("llama_compat", "space", "testing")


def imported(path: Path) -> set[str]:
    """The package's own modules a file imports, as top-level names under dflash_runtime ("space", "hub", ...)."""
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 for a core module, 1 inside a subpackage
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "dflash_runtime" and len(parts) > 1:
                    names.add(parts[1])
                continue
            if node.level - 1 < depth:
                continue  # within the same subpackage
            if node.module:
                names.add(node.module.split(".")[0])
            else:
                names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("path", sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py"),
                         ids=lambda p: p.name)
def test_the_core_imports_nothing_above_it(path: Path) -> None:
    assert not imported(path) & set(ABOVE_CORE)


@pytest.mark.parametrize("path", sorted((PACKAGE / "llama_compat").glob("*.py")), ids=lambda p: p.name)
def test_the_drop_in_imports_nothing_of_the_space_or_the_test_models(path: Path) -> None:
    assert not imported(path) & {"space", "testing"}


@pytest.mark.parametrize("path", sorted((PACKAGE / "space").glob("*.py")), ids=lambda p: p.name)
def test_the_space_imports_nothing_of_the_test_models(path: Path) -> None:
    assert "testing" not in imported(path)  # app.py hands the offline demo its generated pair


def test_the_check_sees_imports_across_levels() -> None:
    sub = PACKAGE / "llama_compat" / "llama.py"
    assert "hub" in imported(sub)  # a relative import two levels up is seen
    assert "engine" in imported(PACKAGE / "__init__.py")
