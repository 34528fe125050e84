"""Abuse every `pipeirc` command the way a new user would (issue 11), and count what goes wrong.

    python bench/abuse.py [--quick] [--jobs 2] [--generated 40] [--seed 11] [--only TEXT]
                          [--no-open] [-v]

Each input runs as its own `pipeirc` subprocess, in its own session and its own scratch
directory, under a time bound (and, for the cases that used to exhaust memory, an address
space limit). After it ends the script counts:

- tracebacks: "Traceback (most recent call last)" anywhere in its output;
- hangs:      still running at its time bound (then its whole session is killed);
- orphans:    a process of its session still alive 5 s after it ended (then killed);
- files lost: a file, link, FIFO or device that existed before and was not the output,
              changed or vanished; or the output itself changed kind (a link became a file,
              a FIFO or device was replaced) or mode;
- unclear:    a bad input that did not end with exit code 1 or 2 and an `error:` line
              (or a good one that failed);
- stray:      a file left in the scratch directory that nobody asked for (a temporary).

Inputs: every writer against links, FIFOs, devices, /proc, missing and existing directories;
bad option values; bad cost files; plugins named like built-ins; killed runs; run-time
guards; generated ones (random bad values for numeric options, random byte edits of the
examples); inputs that used to exhaust memory or time (`.sched` recursion and integers,
torch CSVs, /dev/zero, library sizes, pass outputs, lowering), each under a 2 GiB address
space bound. Cases marked "open" are issue 11's remaining parts: they are counted separately
and do not fail the script. Exit status: 1 if any other case fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import os
import random
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

REPO = Path(__file__).resolve().parent.parent
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


@dataclass
class Outcome:
    case: Case
    code: int | None
    seconds: float
    problems: dict[str, str] = field(default_factory=dict)


# ---- scratch directory helpers --------------------------------------------------------------
def _fifo(name: str) -> Setup:
    return lambda d: os.mkfifo(d / name)


def _file(name: str, text: str = "keep me\n", mode: int = 0o640) -> Setup:
    def make(d: Path) -> None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
        (d / name).chmod(mode)
    return make


def _link(name: str, target: str) -> Setup:
    return lambda d: (d / name).symlink_to(target)


def _dir(name: str) -> Setup:
    return lambda d: (d / name).mkdir()


def _all(*steps: Setup) -> Setup:
    def make(d: Path) -> None:
        for s in steps:
            s(d)
    return make


_CSV: list[str] = []


def _csv(name: str) -> Setup:
    """A torch CSV of the 1F1B example, made once by export-torch itself."""
    def make(d: Path) -> None:
        if not _CSV:
            r = subprocess.run([sys.executable, "-m", "pipeir", "export-torch", SCHED],
                               capture_output=True, text=True, timeout=60)
            _CSV.append(r.stdout)
        (d / name).write_text(_CSV[0])
    return make


# ---- the cases --------------------------------------------------------------------------
#: command -> (arguments before the output path, suffix of the output, fast to succeed)
FILE_WRITERS: dict[str, tuple[list[str], str, bool]] = {
    "print": (["print", SCHED, "-o"], ".sched", True),
    "opt": (["opt", SCHED, "--passes", "verify", "-o"], ".sched", True),
    "simulate --trace": (["simulate", SCHED, "--trace"], ".json", True),
    "run --trace": ([*RUN2, "--steps", "1", "--trace"], ".json", False),
    "run --metrics": ([*RUN2, "--steps", "1", "--metrics"], ".jsonl", False),
    "plot": (["plot", SCHED, "-o"], ".png", True),
    "tune": (["tune", "--costs", COSTS, "--microbatches", "8", "--max-v", "2", "-o"],
             ".sched", True),
    "profile": (["profile", "--model", SMALL, "--nproc", "1", "--iters", "1", "--warmup",
                 "0", "-o"], ".json", False),
    "import-torch": (["import-torch", "in.csv", "-o"], ".sched", True),
    "export-torch": (["export-torch", SCHED, "-o"], ".csv", True),
}
DIR_WRITERS: dict[str, list[str]] = {
    "opt --dump-dir": ["opt", SCHED, "--passes", "verify", "--dump-dir"],
    "compile": ["compile", SCHED, "-o"],
}


def writer_cases() -> list[Case]:
    out = []
    for name, (head, suffix, fast) in FILE_WRITERS.items():
        pre = _csv("in.csv") if name == "import-torch" else None

        def case(what: str, target: str, setup: Setup | None = None,
                 expect: frozenset[int] = ERROR, outputs: tuple[str, ...] = (),
                 quick: bool = True, name: str = name, head: list[str] = head,
                 pre: Setup | None = pre, slow: bool = not fast) -> Case:
            steps = [s for s in (pre, setup) if s is not None]
            return Case(f"{name} -> {what}", [*head, target], expect,
                        _all(*steps) if steps else None, outputs,
                        timeout=120 if slow and expect == OK else 30, quick=quick)

        out += [
            case("FIFO", "out" + suffix, _fifo("out" + suffix)),
            case("/dev/full", "/dev/full"),
            case("/dev/null", "/dev/null", quick=False),
            case("/dev/stdout", "/dev/stdout"),
            case("/proc/version", "/proc/version"),
            case("/proc/self/x", "/proc/self/x" + suffix, quick=False),
            case("a missing directory", "no/such/dir/x" + suffix, quick=False),
            case("an existing directory", "adir", _dir("adir"), quick=False),
            case("a link into a missing directory", "dangling" + suffix,
                 _link("dangling" + suffix, "nowhere/x" + suffix), quick=False),
            case("a link to a 0604 file", "link" + suffix,
                 _all(_file("real" + suffix, mode=0o604), _link("link" + suffix,
                                                                "real" + suffix)),
                 OK, ("real" + suffix,), quick=fast and name in ("print", "plot")),
            case("an existing 0640 file", "mode" + suffix, _file("mode" + suffix), OK,
                 ("mode" + suffix,), quick=False),
        ]
    for name, head in DIR_WRITERS.items():
        out += [
            Case(f"{name} -> FIFO", [*head, "d"], setup=_fifo("d"), quick=True),
            Case(f"{name} -> /proc/pipeir", [*head, "/proc/pipeir"], quick=True),
            Case(f"{name} -> an existing file", [*head, "f"], setup=_file("f")),
        ]
    out += [
        Case("compile -> a user's directory", ["compile", SCHED, "-o", "user"],
             setup=_file("user/main.py"), quick=True),
        Case("compile --force -> a user's directory", ["compile", SCHED, "-o", "user",
                                                       "--force"],
             OK, _all(_file("user/main.py"), _file("user/notes.txt")),
             ("user/main.py", "user/rank0.py", "user/rank1.py", "user/rank2.py",
              "user/rank3.py", "user/lowered.json", "user/.pipeir-compile")),
    ]
    return out


MODELS = '''
import torch
from pipeir.models import ModelSpec
from pipeir.models.mlp import small

def nan_loss():
    base = small()
    def batch(step):
        x, y = base.batch(step)
        return (x * float("nan") if step == 1 else x), y
    return ModelSpec(stage=base.stage, loss=base.loss, batch=batch)

def unseeded():
    base = small()
    def batch(step):
        x = torch.randn(64, 64)
        return x, torch.tanh(x)
    return ModelSpec(stage=base.stage, loss=base.loss, batch=batch)
'''

PLUGIN = '''
from dataclasses import dataclass
from typing import ClassVar
from pipeir.passes import Pass

@dataclass(frozen=True)
class Fake(Pass):
    name: ClassVar[str] = "interleave"
    summary: ClassVar[str] = "not the real one"
    def run(self, schedule, context):
        return schedule
'''

LIB = ["--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"]


def option_cases() -> list[Case]:
    """The bad options and files issue 11 lists, each once."""
    q = True
    cases = [
        Case("run --timeout nan", [*RUN2, "--timeout", "nan"], quick=q),
        Case("run --timeout 0", [*RUN2, "--timeout", "0"], quick=q),
        Case("run --timeout -1", [*RUN2, "--timeout", "-1"]),
        Case("run --timeout 1e300", [*RUN2, "--timeout", "1e300"]),
        Case("run --steps 0", [*RUN2, "--steps", "0"]),
        Case("profile --timeout nan", ["profile", "--model", SMALL, "-o", "p.json",
                                       "--timeout", "nan"]),
        Case("tune --memory-limit nan", ["tune", "--costs", COSTS, "--memory-limit", "nan"],
             quick=q),
        Case("tune --memory-limit -1", ["tune", "--costs", COSTS, "--memory-limit", "-1"]),
        Case("tune --memory-limit 0.5 (nothing fits)",
             ["tune", "--costs", COSTS, "--memory-limit", "0.5"], quick=q),
        Case("tune --lengths -1,0", ["tune", "--costs", COSTS, "--lengths", "-1,0"], quick=q),
        Case("show --width 0", ["show", *LIB, "--width", "0"], quick=q),
        Case("simulate --width 0", ["simulate", *LIB, "--width", "0"]),
        Case("check --memory-limit nan", ["check", SCHED, "--memory-limit", "nan"]),
        Case("compile --max-posted -1", ["compile", SCHED, "--emit", "lowered",
                                         "--max-posted", "-1"]),
        Case("pipeirc --version", ["--version"], OK, quick=q),
        Case("simulate a torch CSV", ["simulate", "in.csv"], setup=_csv("in.csv"), quick=q),
        Case("compile a torch CSV", ["compile", "in.csv", "-o", "out"], setup=_csv("in.csv")),
        Case("show a torch CSV", ["show", "in.csv"], setup=_csv("in.csv")),
        Case("--pass-plugin named like a built-in",
             ["opt", *LIB, "--passes", "interleave{v=2}", "--pass-plugin", "fake.py:Fake"],
             setup=_file("fake.py", PLUGIN), quick=q),
        Case("passes --pass-plugin named like a built-in",
             ["passes", "--pass-plugin", "fake.py:Fake"], setup=_file("fake.py", PLUGIN)),
        Case("simulate --set F=1e308", ["simulate", *LIB, "--set", "F=1e308"], quick=q),
        Case("plot --set F=1e308", ["plot", *LIB, "--set", "F=1e308", "-o", "x.png"]),
        Case("simulate --set bandwidth=1e-300", ["simulate", *LIB, "--set",
                                                 "bandwidth=1e-300"]),
        Case("tune costs 1e308", ["tune", "--costs", "c.toml"],
             setup=_file("c.toml", "F = 1e308\n[stage.0]\nF = 1.0\n"), quick=q),
        Case("tune [stage.99] typo", ["tune", "--costs", "c.toml"],
             setup=_file("c.toml", "F = 1.0\n[stage.0]\nF = 2.0\n[stage.99]\nF = 3.0\n"),
             quick=q),
        Case("cost file with a 5000-digit integer", ["simulate", *LIB, "--costs", "c.json"],
             setup=_file("c.json", '{"F": ' + "9" * 5000 + "}")),
        Case("simulate with fewer lengths than micro-batches",
             ["simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "16",
              "--costs", str(REPO / "examples/costs/lengths.toml")]),
        Case("check --lowered a torch CSV", ["check", "--lowered", "in.csv"], OK,
             setup=_csv("in.csv")),
        Case("check a directory", ["check", str(REPO / "examples")]),
        Case("check a missing file", ["check", "missing.sched"]),
    ]
    return cases


def runtime_cases() -> list[Case]:
    """Runs that must stop cleanly: killed launchers, NaN losses, ranks on different data."""
    models = _file("models.py", MODELS)
    waiting = ("step    2/", )
    return [
        Case("kill -KILL pipeirc run", [*RUN2, "--steps", "100000"], frozenset({-9}),
             kill=(signal.SIGKILL, waiting[0]), timeout=120),
        Case("kill -TERM pipeirc run", [*RUN2, "--steps", "100000"], frozenset({-15}),
             kill=(signal.SIGTERM, waiting[0]), timeout=120),
        Case("run --trace with a schedule-level pass",
             [*RUN2, "--passes", "split-backward", "--steps", "1", "--trace", "t.json"], OK,
             outputs=("t.json",), timeout=120),
        Case("run: NaN loss", ["run", SCHED, "--set", "ranks=2", "--set", "microbatches=2",
                               "--model", "models.py:nan_loss", "--steps", "3"],
             frozenset({1}), models, timeout=120),
        Case("run: ranks see different batches",
             ["run", SCHED, "--set", "ranks=2", "--set", "microbatches=2", "--model",
              "models.py:unseeded", "--steps", "3"], frozenset({1}), models, timeout=120),
    ]


GiB = 2**30


def resource_cases() -> list[Case]:
    """Inputs that used to exhaust memory or time (issue 11's resource part): each must be
    refused before the work, naming the limit (pipeir/limits.py), under 2 GiB of address
    space and well within its time bound."""
    deep = "def f40(x) = x\n" + "".join(f"def f{i}(x) = f{i + 1}(f{i + 1}(x))\n"
                                        for i in reversed(range(40)))
    bound = {"timeout": 15.0, "memory": 2 * GiB}
    return [
        Case("check /dev/zero", ["check", "/dev/zero"], quick=True, **bound),
        Case("simulate --costs /dev/zero", ["simulate", SCHED, "--costs", "/dev/zero"],
             **bound),
        Case("import-torch /dev/zero", ["import-torch", "/dev/zero"], **bound),
        Case("compile accumulate = 10**12",
             ["compile", SCHED, "--set", "accumulate=1000000000000", "--emit", "lowered"],
             quick=True, **bound),
        Case("helper calls 40 deep", ["check", "deep.sched"],
             setup=_file("deep.sched", "pipeline { ranks = 1 microbatches = 1 }\n" + deep +
                         "schedule s { rank r { let k = f0(0)\n F(r, k) B(r, k) } }\n"),
             quick=True, **bound),
        Case("10**16384 as a stage", ["check", "big.sched"],
             setup=_file("big.sched", "pipeline { ranks = 2 microbatches = 2 }\n"
                         "schedule s { rank r { F(1" + "0" * 16384 + ", 0) } }\n"),
             quick=True, **bound),
        Case("integers past 64 bits by arithmetic", ["check", "mul.sched"],
             setup=_file("mul.sched", "pipeline { ranks = 1 microbatches = 1 }\n"
                         "def sq(x, n) = sq(x * x, n - 1)\n"
                         "schedule s { rank r { let k = sq(3, 150)\n F(r, 0) B(r, 0) } }\n"),
             **bound),
        Case("a 5000-digit rank number", ["check", "rank.sched"],
             setup=_file("rank.sched", "pipeline { ranks = 1 microbatches = 1 }\n"
                         "schedule s { rank " + "9" * 5000 + " { F(0,0) B(0,0) } }\n"),
             **bound),
        Case("a 5000-digit stage in a costs block", ["simulate", "cost.sched"],
             setup=_file("cost.sched", "pipeline { ranks = 1 microbatches = 1 }\n"
                         "costs { stage." + "9" * 5000 + ".F = 1 }\nschedule = 1f1b\n"),
             **bound),
        Case("--set a 5000-digit micro-batch cost", ["simulate", SCHED, "--set",
                                                     "mb." + "9" * 5000 + ".F=1"], **bound),
        Case("tune --microbatches with 5000 digits",
             ["tune", "--costs", COSTS, "--microbatches", "9" * 5000], **bound),
        Case("bubble --ranks with 5000 digits", ["bubble", "--ranks", "9" * 5000], **bound),
        Case("torch CSV with a 5000-digit stage", ["check", "huge.csv"],
             setup=_file("huge.csv", "9" * 5000 + "F0\n"), **bound),
        Case("torch CSV 0F99999999999999999999", ["check", "huge.csv"],
             setup=_file("huge.csv", "0F99999999999999999999\n"), **bound),
        Case("torch CSV 999999999F0", ["check", "huge.csv"],
             setup=_file("huge.csv", "999999999F0\n"), quick=True, **bound),
        Case("import-torch 999999999F0", ["import-torch", "huge.csv"],
             setup=_file("huge.csv", "999999999F0\n"), **bound),
        Case("opt interleave{v=1000000}", ["opt", SCHED, "--passes", "interleave{v=1000000}"],
             quick=True, **bound),
        Case("check --ranks 2000 --microbatches 2000",
             ["check", "--schedule", "1f1b", "--ranks", "2000", "--microbatches", "2000"],
             quick=True, **bound),
        Case("compile interleaved p=128 v=8 m=1024",
             ["compile", "--schedule", "interleaved-1f1b", "--ranks", "128", "--v", "8",
              "--microbatches", "1024", "-o", "out"], **bound),
        Case("run accumulate = 10**12", [*RUN2, "--set", "accumulate=1000000000000"],
             timeout=60),
        Case("run interleave{v=4000}: more model than memory",
             [*RUN2_MLP, "--passes", "interleave{v=4000}"], timeout=240, memory=6 * GiB),
        Case("run interleave{v=100} over PIPEIR_MAX_MEMORY=600MB",
             [*RUN2_MLP, "--passes", "interleave{v=100}"], env={"PIPEIR_MAX_MEMORY": "600MB"},
             timeout=60),
        Case("PIPEIR_MAX_MEMORY=lots", ["check", SCHED], env={"PIPEIR_MAX_MEMORY": "lots"},
             **bound),
        Case("PIPEIR_MAX_MEMORY=1KiB", ["check", SCHED], env={"PIPEIR_MAX_MEMORY": "1KiB"},
             **bound),
    ]


def open_cases() -> list[Case]:
    """Issue 11's parts still open (none counted against the script)."""
    return []


#: option -> values that must be refused (numeric options of every command)
BAD_NUMBERS = ("nan", "inf", "-inf", "-1", "-1,0", "x", "", "1e999", "9" * 5000, "0x10",
               "1e-400", "--")
GENERATED_OPTIONS: list[tuple[list[str], str, tuple[str, ...]]] = [
    (["check", SCHED], "--memory-limit", ("0",)),
    (["show", *LIB], "--width", ("0",)),
    (["simulate", *LIB], "--width", ("0", "3")),
    (["run", *LIB, "--model", SMALL], "--timeout", ("0",)),
    (["run", *LIB, "--model", SMALL], "--steps", ("0",)),
    (["run", *LIB, "--model", SMALL], "--nproc", ("0", "3")),
    (["compile", *LIB, "--emit", "lowered"], "--max-posted", ()),
    (["tune", "--costs", COSTS], "--memory-limit", ("0",)),
    (["tune", "--costs", COSTS], "--lengths", ("0", "4,0")),
    (["tune", "--costs", COSTS], "--microbatches", ("0",)),
    (["tune", "--costs", COSTS], "--top", ("0",)),
    (["tune", "--costs", COSTS], "--max-v", ("0",)),
    (["tune", "--costs", COSTS], "--ranks", ("0", "1")),
    (["profile", "--model", SMALL, "-o", "p.json"], "--nproc", ("0",)),
    (["profile", "--model", SMALL, "-o", "p.json"], "--iters", ("0",)),
    (["profile", "--model", SMALL, "-o", "p.json"], "--timeout", ("0",)),
    (["bubble"], "--ranks", ("0",)),
    (["bubble"], "--microbatches", ("0",)),
    (["simulate", *LIB], "--set", ("F=nan", "F=-1", "latency=-1", "F=1e308", "bandwidth=0")),
    (["check", *LIB], "--set", ("ranks=0", "microbatches=-1", "ranks=nan")),
    (["import-torch", "in.csv"], "--microbatches", ("0",)),
]


def generated_cases(n: int, seed: int) -> list[Case]:
    """`n` random bad option values, then `n` random byte edits of the examples."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        head, opt, extra = rnd.choice(GENERATED_OPTIONS)
        value = rnd.choice((*BAD_NUMBERS, *extra))
        setup = _csv("in.csv") if head[0] == "import-torch" else None
        shown = value if len(value) < 20 else f"{value[:8]}...({len(value)} chars)"
        out.append(Case(f"generated #{i}: {head[0]} {opt} {shown!r}", [*head, opt, value],
                        setup=setup, quick=i < 3))
    examples = sorted((REPO / "examples").glob("*.sched"))
    for i in range(n):
        src = rnd.choice(examples).read_bytes()
        data = bytearray(src)
        for _ in range(rnd.randint(1, 6)):
            at = rnd.randrange(len(data))
            data[at:at + rnd.randint(0, 4)] = bytes(rnd.randrange(256)
                                                    for _ in range(rnd.randint(0, 3)))
        cmd = rnd.choice((["check"], ["simulate"], ["print"], ["show"],
                          ["compile", "--emit", "lowered"]))
        out.append(Case(f"generated edit #{i}: {cmd[0]} of {len(data)} bytes",
                        [*cmd, "edited.sched"], ANY,
                        _file("edited.sched", data.decode("latin-1")), quick=i < 2))
    return out


def all_cases(generated: int, seed: int) -> list[Case]:
    return [*writer_cases(), *option_cases(), *runtime_cases(), *resource_cases(), *open_cases(),
            *generated_cases(generated, seed)]


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
    before = snapshot(work)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "100", **case.env}
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "pipeir", *case.argv], cwd=work,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         errors="replace", start_new_session=True, env=env)
    if case.memory is not None:  # set from here: preexec_fn is unsafe with threads
        resource.prlimit(p.pid, resource.RLIMIT_AS, (case.memory, case.memory))
    problems: dict[str, str] = {}
    out = err = ""
    try:
        if case.kill is not None:
            out = _kill_when(p, case, t0)
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
    lost, stray = compare(before, snapshot(work), case.outputs)
    if lost:
        problems["files lost"] = "; ".join(lost)
    if stray:
        problems["stray"] = ", ".join(stray[:3])
    shutil.rmtree(work, ignore_errors=True)
    return Outcome(case, p.returncode, seconds, problems)


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the fast subset (the test's)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    ap.add_argument("--generated", type=int, default=40,
                    help="random bad option values, and as many random file edits")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--only", metavar="TEXT", help="only cases whose name contains TEXT")
    ap.add_argument("--no-open", action="store_true", help="skip the known open cases")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the clean cases too")
    args = ap.parse_args(argv)
    if not Path("/proc/self/stat").exists():
        print("abuse.py needs Linux /proc (sessions, orphans)", file=sys.stderr)
        return 2
    cases = all_cases(args.generated, args.seed)
    if args.quick:
        cases = [c for c in cases if c.quick]
    if args.no_open or args.quick:
        cases = [c for c in cases if c.open is None]
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    old = os.umask(0o022)
    try:
        with tempfile.TemporaryDirectory(prefix="pipeir-abuse.") as root, \
                concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            outcomes = list(pool.map(lambda c: run_case(c, Path(root)), cases))
    finally:
        os.umask(old)
    return report(outcomes, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
