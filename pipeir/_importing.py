"""Importing a user's Python file (a pass plugin, a model spec) by path."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from pipeir.diagnostics import UsageError, mark_input
from pipeir.usercode import contained


def import_file(path: Path, prefix: str, label: str) -> ModuleType:
    """Import `path` under a private module name derived from its absolute path (so two files
    with the same stem do not collide, and every process picks the same name), registered in
    sys.modules as dataclasses and pickling need. Errors start with `label` (e.g. "--model
    'x.py'"): a bad path is a UsageError, anything the file raises while importing (even
    `sys.exit`) a `UserCodeError` naming its line, never a traceback."""
    if not path.is_file():
        raise UsageError(f"{label}: no such file {path}")
    mark_input(path)  # an output must not replace it (`pipeir.files`)
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"{prefix}_{digest}_{path.stem}" if path.stem.isidentifier() else f"{prefix}_{digest}"
    module = sys.modules.get(name)
    if module is not None:
        return module
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(f"{label}: cannot load {path}")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        with contained(label, f"importing {path}"):
            loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
