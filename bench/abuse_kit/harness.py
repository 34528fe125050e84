"""The abuse harness (bench/abuse.py): a `Case` is one `pipeirc` invocation and what a clean
outcome is; `run_case` runs it in its own session and scratch directory and counts what went
wrong (see bench/abuse.py's docstring for the counts); `report` prints the summary."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCHED = str(REPO / "examples/1f1b.sched")
COSTS = str(REPO / "examples/costs/compute-bound.toml")
SMALL = "pipeir.models.mlp:small"
RUN2 = ["run", SCHED, "--set", "ranks=2", "--set", "microbatches=2", "--model", SMALL]
RUN2_MLP = [*RUN2[:-1], "mlp"]  # the default width: 3 MB of state per stage
ERROR = frozenset({1, 2})
OK = frozenset({0})
ANY = frozenset({0, 1, 2})
DEVICES = ("/dev/full", "/dev/null")

Setup = Callable[[Path], None]


@dataclass
class Case:
    """One `pipeirc` invocation and what a clean outcome is."""

    name: str
    argv: list[str]
    expect: frozenset[int] = ERROR
    setup: Setup | None = None
    #: scratch paths the command may replace (a link's target, a written file or directory)
    outputs: tuple[str, ...] = ()
    timeout: float = 30.0
    quick: bool = False
    #: kill the command with this signal once this text is on its stdout (orphan checks)
    kill: tuple[signal.Signals, str] | None = None
    #: issue 11's remaining parts: counted apart, never fail the script
    open: str | None = None
    #: bytes of address space the command may use (for the cases that exhausted memory)
    memory: int | None = None
    #: extra environment variables
    env: dict[str, str] = field(default_factory=dict)
    #: send SIGINT after this many seconds (user code that loops: the user's Ctrl-C)
    interrupt_after: float | None = None
    #: a `pipeirc` command started first, in the same scratch directory; the case starts
    #: once its stdout shows the text, and it must still end with exit 0 (concurrent writers)
    alongside: tuple[list[str], str] | None = None
    #: after the run: (count, what is wrong) or None, given the scratch directory, stdout
    #: and stderr
    check: Callable[[Path, str, str], tuple[str, str] | None] | None = None


@dataclass
class Outcome:
    case: Case
    code: int | None
    seconds: float
    problems: dict[str, str] = field(default_factory=dict)


# ---- scratch directory helpers --------------------------------------------------------------
def make_fifo(name: str) -> Setup:
    return lambda d: os.mkfifo(d / name)


def make_file(name: str, text: str = "keep me\n", mode: int = 0o640) -> Setup:
    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
        (d / name).chmod(mode)
    return make


def make_link(name: str, target: str) -> Setup:
    return lambda d: (d / name).symlink_to(target)


def make_dir(name: str) -> Setup:
    return lambda d: (d / name).mkdir()


def all_of(*steps: Setup) -> Setup:
    def make(d: Path) -> None:
        for s in steps:
            s(d)
    return make


_CSV: list[str] = []


def make_csv(name: str) -> Setup:
    """A torch CSV of the 1F1B example, made once by export-torch itself."""
    def make(d: Path) -> None:
        if not _CSV:
            r = subprocess.run([sys.executable, "-m", "pipeir", "export-torch", SCHED],
                               capture_output=True, text=True, timeout=60)
            _CSV.append(r.stdout)
        (d / name).write_text(_CSV[0])
    return make


# ---- running one case -------------------------------------------------------------------
Entry = tuple[int, int, str, str]  # kind bits, mode, link target, content hash


def snapshot(root: Path) -> dict[str, Entry]:
    """Every entry below `root` (links not followed), and the watched devices."""
    out: dict[str, Entry] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            p = Path(dirpath) / name
            out[str(p.relative_to(root))] = _entry(p)
    for dev in DEVICES:
        if os.path.lexists(dev):
            out[dev] = _entry(Path(dev))
    return out


def _entry(p: Path) -> Entry:
    st = os.lstat(p)
    kind = stat.S_IFMT(st.st_mode)
    target = os.readlink(p) if stat.S_ISLNK(st.st_mode) else ""
    digest = ""
    if stat.S_ISREG(st.st_mode):
        digest = hashlib.blake2b(p.read_bytes(), digest_size=8).hexdigest()
    elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        digest = str(st.st_rdev)
    return kind, stat.S_IMODE(st.st_mode), target, digest


def compare(before: dict[str, Entry], after: dict[str, Entry],
            outputs: Iterable[str]) -> tuple[list[str], list[str]]:
    """(lost, stray): what changed that was not an output, and new files nobody wrote."""
    outs = set(outputs)
    lost, stray = [], []
    for path, was in before.items():
        now = after.get(path)
        if path in outs:
            if now is None or now[:2] != was[:2]:
                lost.append(f"{path} changed kind or mode")
        elif _under_output(path, outs):  # the command writes there (a checkpoint directory)
            continue
        elif now != was:
            lost.append(f"{path} {'vanished' if now is None else 'changed'}")
    for path in after:
        if path not in before and path not in outs and not _under_output(path, outs):
            stray.append(path)
    return lost, stray


def _under_output(path: str, outs: set[str]) -> bool:
    return any(path.startswith(o + "/") for o in outs)


def _session(sid: int) -> list[int]:
    """Live (non-zombie) processes of session `sid`."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out


def _kill_session(sid: int) -> None:
    for pid in _session(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run_case(case: Case, scratch_root: Path) -> Outcome:
    work = Path(tempfile.mkdtemp(prefix="case.", dir=scratch_root))
    if case.setup is not None:
        case.setup(work)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "100", **case.env}
    problems: dict[str, str] = {}
    other = None if case.alongside is None else _start_alongside(case, work, env, problems)
    before = snapshot(work)
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "pipeir", *case.argv], cwd=work,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         errors="replace", start_new_session=True, env=env)
    if case.memory is not None:  # set from here: preexec_fn is unsafe with threads
        resource.prlimit(p.pid, resource.RLIMIT_AS, (case.memory, case.memory))
    out = err = ""
    try:
        if case.kill is not None:
            out = _kill_when(p, case, t0)
        if case.interrupt_after is not None:
            try:
                p.wait(timeout=case.interrupt_after)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGINT)
        o, e = p.communicate(timeout=max(1.0, case.timeout - (time.monotonic() - t0)))
        out, err = out + o, e
    except subprocess.TimeoutExpired:
        _kill_session(p.pid)
        o, e = p.communicate()
        out, err = out + o, e
        problems["hang"] = f"still running after {case.timeout:g} s"
    seconds = time.monotonic() - t0
    end = time.monotonic() + 5
    while _session(p.pid) and time.monotonic() < end:
        time.sleep(0.1)
    left = _session(p.pid)
    if left:
        problems["orphan"] = f"{len(left)} process(es) left"
        _kill_session(p.pid)
    text = out + err
    if "Traceback (most recent call last)" in text:
        problems["traceback"] = _last_line(text)
    if "hang" not in problems:
        problems.update(_verdict(case, p.returncode, err))
    if other is not None:
        problems.update(_end_alongside(other, case))
    if case.check is not None:
        found = case.check(work, out, err)
        if found is not None:
            problems[found[0]] = found[1]
    lost, stray = compare(before, snapshot(work), case.outputs)
    if lost:
        problems["files lost"] = "; ".join(lost)
    if stray:
        problems["stray"] = ", ".join(stray[:3])
    shutil.rmtree(work, ignore_errors=True)
    return Outcome(case, p.returncode, seconds, problems)


def _start_alongside(case: Case, work: Path, env: dict[str, str],
                     problems: dict[str, str]) -> subprocess.Popen[str]:
    assert case.alongside is not None
    argv, ready = case.alongside
    other = subprocess.Popen([sys.executable, "-m", "pipeir", *argv], cwd=work,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             errors="replace", start_new_session=True, env=env)
    assert other.stdout is not None
    for line in other.stdout:
        if ready in line:
            return other
    problems["unclear"] = f"the run alongside never printed {ready!r}"
    return other


def _end_alongside(other: subprocess.Popen[str], case: Case) -> dict[str, str]:
    try:
        _, err = other.communicate(timeout=case.timeout)
    except subprocess.TimeoutExpired:
        _kill_session(other.pid)
        other.communicate()
        return {"hang": "the run alongside did not end"}
    if other.returncode != 0:
        return {"unclear": f"the run alongside failed ({other.returncode}): {_last_line(err)}"}
    return {}


def _kill_when(p: subprocess.Popen[str], case: Case, t0: float) -> str:
    assert case.kill is not None and p.stdout is not None
    sig, text = case.kill
    seen = []
    for line in p.stdout:
        seen.append(line)
        if text in line:
            os.kill(p.pid, sig)
            break
        if time.monotonic() - t0 > case.timeout:
            break
    return "".join(seen)


def _verdict(case: Case, code: int | None, err: str) -> dict[str, str]:
    if code not in case.expect:
        return {"unclear": f"exit code {code}, expected {sorted(case.expect)}: "
                           f"{_last_line(err)}"}
    if code in ERROR and case.expect <= ERROR:
        first = next((line for line in err.splitlines() if line.strip()), "")
        if not re.match(r"^(\S.*: )?error: ", first):
            return {"unclear": f"no one-line error: {first[:120]!r}"}
    return {}


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


# ---- the report -------------------------------------------------------------------------
COUNTED = ("traceback", "hang", "orphan", "files lost", "unclear", "stray")


def report(outcomes: list[Outcome], verbose: bool) -> int:
    mine = [o for o in outcomes if o.case.open is None]
    known = [o for o in outcomes if o.case.open is not None]
    print(f"inputs tried: {len(outcomes)} ({len(mine)} counted, {len(known)} known open)")
    for key in COUNTED:
        n = sum(key in o.problems for o in mine)
        m = sum(key in o.problems for o in known)
        label = {"traceback": "tracebacks", "hang": "hangs", "orphan": "orphans",
                 "unclear": "unclear outcomes", "stray": "stray files"}.get(key, key)
        print(f"{label + ':':<18}{n:>4}" + (f"   (+{m} in known open cases)" if m else ""))
    failed = [o for o in mine if o.problems]
    for o in failed:
        print(f"FAIL {o.case.name}: " + "; ".join(f"{k}: {v}" for k, v in o.problems.items()))
    for o in known:
        state = "; ".join(f"{k}: {v}" for k, v in o.problems.items()) or "clean now"
        print(f"open {o.case.name} [{o.case.open}]: {state}")
    if verbose:
        for o in mine:
            if not o.problems:
                print(f"ok   {o.case.name} (exit {o.code}, {o.seconds:.1f} s)")
    slowest = max(outcomes, key=lambda o: o.seconds, default=None)
    if slowest is not None:
        print(f"slowest: {slowest.case.name} ({slowest.seconds:.1f} s)")
    return 1 if failed else 0


