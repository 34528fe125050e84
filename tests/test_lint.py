"""ruff and mypy --strict over the whole package: the type checker and linter CI runs.

mypy cannot follow setuptools' package-dir mapping (passes/ and grammar/ install as
pipeir.passes and pipeir.grammar), so it checks a tree of symbolic links laid out the way the
package installs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed")
def test_ruff_clean() -> None:
    r = subprocess.run(["ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_mypy_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    pkg = tmp_path / "pipeir"
    pkg.mkdir()
    for entry in (REPO / "pipeir").iterdir():
        if entry.name != "__pycache__":
            (pkg / entry.name).symlink_to(entry)
    (pkg / "passes").symlink_to(REPO / "passes")
    (pkg / "grammar").symlink_to(REPO / "grammar")
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                        "--cache-dir", str(tmp_path / "cache"), "pipeir"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
