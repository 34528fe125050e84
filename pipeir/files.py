"""Writing users' files: the one writer every command and instrument goes through.

A compiler that is pointed at a training job's directory must never leave a half-written
file behind: everything is written to a temporary file beside the target and renamed.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pipeir.diagnostics import UsageError


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write `data` to `path` via a temporary file and a rename, so a failure leaves no
    half-written file behind."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{path}: is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{path}: directory {parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
