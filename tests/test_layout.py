"""The package's shape, which review keeps finding drifted: modules small enough to read, and
the layers importing one way (the search above the passes, counting imports inside
functions, where a cycle hides from a top-level reading)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent
SOURCES = sorted([*(REPO / "pipeir").rglob("*.py"), *(REPO / "passes").rglob("*.py")])

#: The most lines a module may have: past it, it holds more than one idea.
MAX_LINES = 600


def _module(path: Path) -> str:
    """The installed name of a source file (passes/ installs as pipeir.passes)."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] == "passes":
        parts.insert(0, "pipeir")
    return ".".join(p for p in parts if p != "__init__")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it (functions included), absolute."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_no_module_above_the_limit() -> None:
    long = {str(p.relative_to(REPO)): n for p in SOURCES
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules above {MAX_LINES} lines: {long}"


@pytest.mark.parametrize("layer", ["pipeir.passes", "pipeir.sim", "pipeir.backend",
                                   "pipeir.frontend", "pipeir.verify", "pipeir.schedule"])
def test_lower_layers_never_import_the_search(layer: str) -> None:
    """The `synth` pass reaches the pipeline through the registry's "module:Class" string,
    so nothing below `pipeir.search` imports it, not even inside a function."""
    below = [p for p in SOURCES if _module(p) == layer or _module(p).startswith(layer + ".")]
    assert below
    up = {_module(p): sorted(m for m in _imports(p) if m.startswith("pipeir.search"))
          for p in below}
    assert not {k: v for k, v in up.items() if v}


def test_the_synth_pass_is_registered_by_name() -> None:
    from pipeir.passes.registry import BUILTINS, get
    from pipeir.search.synth_pass import Synth

    assert BUILTINS["synth"] == "pipeir.search.synth_pass:Synth"
    assert get("synth") is Synth
