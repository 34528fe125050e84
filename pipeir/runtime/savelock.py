"""One writer per checkpoint directory: `pipeirc run --save DIR` holds `DIR/.lock` for the
whole run.

NOTE (why flock and a pid): the kernel releases an `fcntl.flock` when its holder dies, however
it dies, so a lock is live exactly while its flock is held: no guessing from pids, which the
system reuses. The pid and host written inside are for the message a second run gets ("pid
4242 on node3 is saving into it"), and to say whose lock a new run took over. The file is
not unlinked at the end (a run could flock the unlinked file while a third creates a new one;
only a directory the run made and saved nothing into goes, lock and all); a free lock is an
empty file. Whoever holds the lock is the only writer, so it removes temporary
`.step-*.tmp-*` directories that dead runs left, when it starts and when it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeir.diagnostics import UsageError
from pipeir.files import check_dir

LOCK = ".lock"
#: what unfinished saves leave: `.step-N.tmp-RUNID` directories, `.latest.tmp-RUNID` files,
#: `.step-N.old-RUNID` (a stale step-N being replaced)
TEMP_GLOBS = (".step-*.tmp*", ".latest.tmp*", ".step-*.old-*")


@dataclass(frozen=True)
class Held:
    """A held lock: `note` says whose stale lock it took over (empty if none)."""

    directory: Path
    fd: int
    created: bool  # the run made the directory: remove it at the end if nothing was saved
    note: str


def acquire(save: str) -> Held:
    """Take the lock of checkpoint directory `save` (creating the directory); a UsageError
    naming the owner if a live run holds it."""
    directory = check_dir(save, "--save")
    created = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise UsageError(f"--save {save}: cannot create the lock {directory / LOCK}: "
                         f"{e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        who = _describe(_read(fd)) or "another process"
        os.close(fd)
        raise UsageError(f"--save {save}: another run is saving into it ({who}); wait for "
                         "it to end or save somewhere else") from None
    before = _describe(_read(fd))
    note = (f"--save {save}: took over the lock of {before}, which is no longer running"
            if before else "")
    me = {"pid": os.getpid(), "host": socket.gethostname(),
          "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
    except OSError as e:
        os.close(fd)
        raise UsageError(f"--save {save}: cannot write the lock {directory / LOCK}: "
                         f"{e.strerror}") from None
    remove_temporaries(directory)
    return Held(directory, fd, created, note)


def release(held: Held) -> None:
    """Remove unfinished saves, free the lock; remove the directory if this run made it and
    saved nothing into it."""
    remove_temporaries(held.directory)
    with contextlib.suppress(OSError):
        os.ftruncate(held.fd, 0)
    if held.created and {p.name for p in held.directory.iterdir()} <= {LOCK}:
        with contextlib.suppress(OSError):
            (held.directory / LOCK).unlink()
            held.directory.rmdir()
    os.close(held.fd)  # closing releases the flock


@contextlib.contextmanager
def holding(save: str | None) -> Iterator[Held | None]:
    """`acquire` for the `with` block (nothing if `save` is None)."""
    if save is None:
        yield None
        return
    held = acquire(save)
    try:
        yield held
    finally:
        release(held)


def remove_temporaries(directory: Path) -> None:
    for tmp in (t for pattern in TEMP_GLOBS for t in directory.glob(pattern)):
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _read(fd: int) -> dict[str, object]:
    try:
        data = os.pread(fd, 4096, 0)
        doc = json.loads(data) if data.strip() else {}
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _describe(doc: dict[str, object]) -> str:
    if "pid" not in doc:
        return ""
    return (f"pid {doc['pid']} on {doc.get('host', '?')}"
            + (f", since {doc['since']}" if doc.get("since") else ""))
