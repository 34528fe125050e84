"""Writing users' files: the one output policy every command and instrument goes through.

A compiler that is pointed at a training job's directory must never lose a user's file or
leave a half-written one behind. NOTE: the policy, in one place:

- a regular file is written to a temporary file beside it and renamed over it (atomic);
- a symbolic link is written through: its target is replaced, the link stays a link;
- a special file (FIFO, device, socket) or anything under /proc or /sys is refused before
  anything is touched: renaming over it would replace a device node with a file;
- a file the command read as an input is refused (`diagnostics.reading`);
- an existing file keeps its mode (and owner, where we may); a new one gets 0666 less the
  umask, as `open()` would give it (mkstemp's 0600 would otherwise leak through the rename);
- a directory we cannot write, a full disk or any other OSError is one `UsageError`,
  never a traceback, and the temporary file is removed.

`write_tree` adds what a directory of generated files needs: a marker file naming what pipeir
wrote there, so a non-empty directory that pipeir did not write is refused (unless forced),
and files of an earlier run that the new one does not write are removed.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from pipeir.diagnostics import Note, UsageError, is_input

#: Kernel file systems: their "regular" files are interfaces, never outputs.
_PSEUDO_ROOTS = ("/proc", "/sys")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def _pseudo_root(resolved: str) -> str | None:
    """The kernel file system (/proc, /sys) `resolved` lies in, if any."""
    return next((root for root in _PSEUDO_ROOTS
                 if resolved == root or resolved.startswith(root + "/")), None)


def _follow(path: str | os.PathLike[str], shown: str) -> tuple[str, str | None]:
    """`path` with every symbolic link followed, and the kernel file system the way there
    passes through, if any: `/dev/stdout` is a link into /proc/self/fd, and writing "through"
    it would rename a file over whatever this process's standard output is."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links in a path
        parent = os.path.realpath(os.path.dirname(current))
        current = os.path.join(parent, os.path.basename(current))
        root = _pseudo_root(current)
        if root is not None or not os.path.islink(current):
            return current, root
        current = os.path.normpath(os.path.join(parent, os.readlink(current)))
    raise UsageError(f"{shown}: cannot write: too many levels of symbolic links")


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def resolve_output(path: str | os.PathLike[str], flag: str = "",
                   ) -> tuple[Path, os.stat_result | None]:
    """Check that `path` may be written under the output policy; commands call it before
    long work too, so a bad output path fails in a second, not after the work.

    Returns the file to replace (symbolic links followed) and its status, or None when it
    does not exist yet. Raises a UsageError naming `path` (after the option `flag`, if
    given) for anything the policy refuses."""
    shown = f"{flag} {os.fspath(path)}".strip()
    if not os.fspath(path):
        raise UsageError(f"{flag or 'output'}: empty path")
    if os.fspath(path).endswith(os.sep):  # Path() would drop the slash and write a file
        raise UsageError(f"{shown}: names a directory; give a file name")
    real, root = _follow(path, shown)
    if root is not None:
        led = "" if os.path.abspath(path).startswith(root) else f"leads to {real}; "
        raise UsageError(f"{shown}: {led}refusing to write under {root} (a kernel file "
                         "system, not a place for output files)")
    target = Path(real)
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise UsageError(f"{shown}: cannot write: {_why(e)}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{shown}: is a directory")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{shown}: is {_kind(st.st_mode)}; pipeir writes only regular files "
                         "and leaves this one alone")
    if st is not None and is_input(st):
        raise UsageError(f"{shown}: is an input of this command; writing it would replace "
                         "what was read: write to another file")
    parent = target.parent
    if not parent.is_dir():
        if os.path.islink(path):
            raise UsageError(f"{shown}: a symbolic link to {target}, whose directory does "
                             "not exist")
        raise UsageError(f"{shown}: directory {Path(path).parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{shown}: cannot write: directory {parent} is not writable")
    if st is not None and not os.access(target, os.W_OK):
        raise UsageError(f"{shown}: cannot write: the file is read-only")
    return target, st


def _new_file_mode() -> int:
    # NOTE: the only portable way to read the umask is to set it and set it back; nothing
    # in pipeir creates files from another thread meanwhile.
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


#: A file's contents: text, bytes, or text in parts, written one after another (never
#: joined), or made by a function as they are written (never whole in memory:
#: `pipeir.backend.program_io.dump_parts`).
Contents = str | bytes | tuple[str, ...] | Callable[[], Iterable[str]]


def _stage(target: Path, st: os.stat_result | None, data: Contents) -> str:
    """Write `data` to a temporary file beside `target` with the mode `target` should have;
    returns its path. The caller renames it into place (or removes it)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            parts = data() if callable(data) else data if isinstance(data, tuple) else (data,)
            for part in parts:
                f.write(part.encode("utf-8") if isinstance(part, str) else part)
            f.flush()
            if st is None:
                os.fchmod(f.fileno(), _new_file_mode())
            else:
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
                with contextlib.suppress(OSError):  # not ours to give away: keep ours
                    os.fchown(f.fileno(), st.st_uid, st.st_gid)
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def write_atomic(path: str | os.PathLike[str], data: str | bytes, flag: str = "") -> None:
    """Write `data` to `path` under the output policy (see the module docstring): atomic,
    through symbolic links, never over a special file, keeping an existing file's mode.
    `flag` (e.g. "-o") names the option in messages."""
    target, st = resolve_output(path, flag)
    tmp = None
    try:
        tmp = _stage(target, st, data)
        os.replace(tmp, target)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"{flag} {os.fspath(path)}: cannot write: {_why(e)}".strip()) from None


def _refuse_pseudo_dir(p: Path, flag: str) -> None:
    _, root = _follow(p, f"{flag} {p}")
    if root is not None:
        raise UsageError(f"{flag} {p}: refusing to write under {root} (a kernel file system)")


def check_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """Check, creating nothing, that the output directory `path` could be made: for options
    whose directory is written long after the command starts (`run --save` after training),
    so a bad one fails at once. `flag` names the option in messages."""
    p = Path(path)
    if not os.fspath(path):
        raise UsageError(f"{flag}: empty path")
    _refuse_pseudo_dir(p, flag)
    if p.exists() and not p.is_dir():
        raise UsageError(f"{flag} {p}: exists and is not a directory")
    if p.is_symlink() and not p.exists():  # mkdir says only "File exists"
        raise UsageError(f"{flag} {p}: a symbolic link to {os.readlink(p)}, which does not "
                         "exist; create that directory first, or give another path")
    there = p.absolute()
    while not there.exists():
        there = there.parent
    if not there.is_dir():
        raise UsageError(f"{flag} {p}: {there} is not a directory")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {p}: cannot write: {there} is not writable")
    return p


def make_dir(path: str | os.PathLike[str], flag: str) -> Path:
    """Create the output directory `path` (and its parents) if needed; `flag` names the
    option in messages. An existing non-directory or an unwritable place is a UsageError."""
    p = check_dir(path, flag)
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {p}: cannot create the directory: {_why(e)}") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {p}: cannot write: the directory is not writable")
    return p


def _marked(directory: Path, marker: str) -> list[str] | None:
    """The file names an earlier `write_tree` recorded in `directory`, or None if it has no
    marker."""
    try:
        text = (directory / marker).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return []
    return [line for line in text.splitlines()
            if line and not line.startswith("#") and "/" not in line and line != marker]


def check_tree(directory: str | os.PathLike[str], marker: str, *, flag: str,
               force: bool) -> None:
    """Refuse (before any work) a non-empty `directory` that `write_tree` did not write,
    unless `force`: it may hold the user's own files under the names we would write."""
    d = Path(directory)
    _refuse_pseudo_dir(d, flag)
    if not d.is_dir() or force or _marked(d, marker) is not None:
        return
    try:
        entries = sorted(e.name for e in d.iterdir())
    except OSError as e:
        raise UsageError(f"{flag} {d}: cannot list the directory: {_why(e)}") from None
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise UsageError(f"{flag} {d}: the directory is not empty ({shown}) and pipeir did "
                         f"not write it (no {marker} file)",
                         notes=[Note("give an empty or new directory, or --force to write "
                                     "into it anyway (files of the same names are replaced)")])


def write_tree(directory: str | os.PathLike[str], files: Mapping[str, Contents],
               marker: str, *, flag: str, force: bool) -> None:
    """Write `files` (name -> contents) into `directory` under the output policy.

    Every file is staged first and renamed into place only when all are staged, so a full
    disk leaves the directory as it was. The marker file records the names written; files an
    earlier call recorded that this one does not write (rank3.py of a compile for more ranks)
    are removed."""
    check_tree(directory, marker, flag=flag, force=force)
    created = not os.path.lexists(directory)
    d = make_dir(directory, flag)
    old = _marked(d, marker) or []
    listing = "# written by pipeir; files it removes when it writes here again\n" + \
        "".join(f"{name}\n" for name in files)
    everything: dict[str, Contents] = {**files, marker: listing}
    targets = {name: resolve_output(d / name) for name in everything}
    staged: dict[str, str] = {}
    try:
        for name, data in everything.items():
            target, st = targets[name]
            staged[name] = _stage(target, st, data)
        for name, tmp in staged.items():
            os.replace(tmp, targets[name][0])
    except BaseException as e:  # (contents made while written can fail, or be interrupted)
        for tmp in staged.values():
            Path(tmp).unlink(missing_ok=True)
        if created:  # (a directory it made for nothing goes too: nothing half-written)
            with contextlib.suppress(OSError):
                d.rmdir()
        if isinstance(e, OSError):
            raise UsageError(f"{flag} {d}: cannot write: {_why(e)}") from None
        raise
    for name in old:
        if name not in everything:
            stale = d / name
            if stale.is_file() or stale.is_symlink():
                try:
                    stale.unlink()
                except OSError as e:
                    raise UsageError(f"{flag} {d}: cannot remove the stale {name}: "
                                     f"{_why(e)}") from None
