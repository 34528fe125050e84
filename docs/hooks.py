"""mkdocs hook: give mkdocstrings the package as it is installed.

pipeir installs `passes/` and `grammar/` as `pipeir.passes` and `pipeir.grammar` (pyproject's
`package-dir`), which a reader of source folders (griffe) cannot see: it finds `pipeir/` and no
`passes` inside it. This hook lays out `build/api-source/pipeir/` as the installed package,
with symbolic links to the real files, and mkdocs.yml points mkdocstrings there. It runs when
mkdocs loads it, before any page is rendered.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
VIEW = ROOT / "build" / "api-source"


def lay_out() -> None:
    """`VIEW/pipeir/...` linking every installed module to its file in the repository."""
    package_dir: dict[str, str] = tomllib.loads(
        (ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    if VIEW.exists():
        shutil.rmtree(VIEW)
    # parents before children: pipeir/ is made before pipeir/passes links into it
    for name, src in sorted(package_dir.items(), key=lambda kv: kv[0].count(".")):
        dest = VIEW.joinpath(*name.split("."))
        dest.mkdir(parents=True, exist_ok=True)
        for entry in (ROOT / src).iterdir():
            if entry.name != "__pycache__" and not (dest / entry.name).exists():
                (dest / entry.name).symlink_to(entry)


lay_out()
