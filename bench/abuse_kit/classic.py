"""The families of issue 11: writers against links, FIFOs, devices and /proc; bad options and
files; killed runs and run-time guards; inputs that exhausted memory or time; generated bad
option values and byte edits of the examples."""

from __future__ import annotations

import random
import signal

from abuse_kit.harness import (
    ANY,
    COSTS,
    ERROR,
    OK,
    REPO,
    RUN2,
    RUN2_MLP,
    SCHED,
    SMALL,
    Case,
    Setup,
    all_of,
    make_csv,
    make_dir,
    make_fifo,
    make_file,
    make_link,
)

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
        pre = make_csv("in.csv") if name == "import-torch" else None

        def case(what: str, target: str, setup: Setup | None = None,
                 expect: frozenset[int] = ERROR, outputs: tuple[str, ...] = (),
                 quick: bool = True, name: str = name, head: list[str] = head,
                 pre: Setup | None = pre, slow: bool = not fast) -> Case:
            steps = [s for s in (pre, setup) if s is not None]
            return Case(f"{name} -> {what}", [*head, target], expect,
                        all_of(*steps) if steps else None, outputs,
                        timeout=120 if slow and expect == OK else 30, quick=quick)

        out += [
            case("FIFO", "out" + suffix, make_fifo("out" + suffix)),
            case("/dev/full", "/dev/full"),
            case("/dev/null", "/dev/null", quick=False),
            case("/dev/stdout", "/dev/stdout"),
            case("/proc/version", "/proc/version"),
            case("/proc/self/x", "/proc/self/x" + suffix, quick=False),
            case("a missing directory", "no/such/dir/x" + suffix, quick=False),
            case("an existing directory", "adir", make_dir("adir"), quick=False),
            case("a link into a missing directory", "dangling" + suffix,
                 make_link("dangling" + suffix, "nowhere/x" + suffix), quick=False),
            case("a link to a 0604 file", "link" + suffix,
                 all_of(make_file("real" + suffix, mode=0o604), make_link("link" + suffix,
                                                                "real" + suffix)),
                 OK, ("real" + suffix,), quick=fast and name in ("print", "plot")),
            case("an existing 0640 file", "mode" + suffix, make_file("mode" + suffix), OK,
                 ("mode" + suffix,), quick=False),
        ]
    for name, head in DIR_WRITERS.items():
        out += [
            Case(f"{name} -> FIFO", [*head, "d"], setup=make_fifo("d"), quick=True),
            Case(f"{name} -> /proc/pipeir", [*head, "/proc/pipeir"], quick=True),
            Case(f"{name} -> an existing file", [*head, "f"], setup=make_file("f")),
        ]
    out += [
        Case("compile -> a user's directory", ["compile", SCHED, "-o", "user"],
             setup=make_file("user/main.py"), quick=True),
        Case("compile --force -> a user's directory", ["compile", SCHED, "-o", "user",
                                                       "--force"],
             OK, all_of(make_file("user/main.py"), make_file("user/notes.txt")),
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
        Case("simulate a torch CSV", ["simulate", "in.csv"], setup=make_csv("in.csv"), quick=q),
        Case("compile a torch CSV", ["compile", "in.csv", "-o", "out"], setup=make_csv("in.csv")),
        Case("show a torch CSV", ["show", "in.csv"], setup=make_csv("in.csv")),
        Case("--pass-plugin named like a built-in",
             ["opt", *LIB, "--passes", "interleave{v=2}", "--pass-plugin", "fake.py:Fake"],
             setup=make_file("fake.py", PLUGIN), quick=q),
        Case("passes --pass-plugin named like a built-in",
             ["passes", "--pass-plugin", "fake.py:Fake"], setup=make_file("fake.py", PLUGIN)),
        Case("simulate --set F=1e308", ["simulate", *LIB, "--set", "F=1e308"], quick=q),
        Case("plot --set F=1e308", ["plot", *LIB, "--set", "F=1e308", "-o", "x.png"]),
        Case("simulate --set bandwidth=1e-300", ["simulate", *LIB, "--set",
                                                 "bandwidth=1e-300"]),
        Case("tune costs 1e308", ["tune", "--costs", "c.toml"],
             setup=make_file("c.toml", "F = 1e308\n[stage.0]\nF = 1.0\n"), quick=q),
        Case("tune [stage.99] typo", ["tune", "--costs", "c.toml"],
             setup=make_file("c.toml", "F = 1.0\n[stage.0]\nF = 2.0\n[stage.99]\nF = 3.0\n"),
             quick=q),
        Case("cost file with a 5000-digit integer", ["simulate", *LIB, "--costs", "c.json"],
             setup=make_file("c.json", '{"F": ' + "9" * 5000 + "}")),
        Case("simulate with fewer lengths than micro-batches",
             ["simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "16",
              "--costs", str(REPO / "examples/costs/lengths.toml")]),
        Case("check --lowered a torch CSV", ["check", "--lowered", "in.csv"], OK,
             setup=make_csv("in.csv")),
        Case("check a directory", ["check", str(REPO / "examples")]),
        Case("check a missing file", ["check", "missing.sched"]),
    ]
    return cases


def runtime_cases() -> list[Case]:
    """Runs that must stop cleanly: killed launchers, NaN losses, ranks on different data."""
    models = make_file("models.py", MODELS)
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
    # (distinct arguments at every level: a function called again with its arguments is
    # answered from its first call, so f(f(x)) no longer fans out)
    deep = "def f40(x) = x\n" + "".join(f"def f{i}(x) = f{i + 1}(2 * x) + f{i + 1}(2 * x + 1)\n"
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
             setup=make_file("deep.sched", "pipeline { ranks = 1 microbatches = 1 }\n" + deep +
                         "schedule s { rank r { let k = f0(0)\n F(r, k) B(r, k) } }\n"),
             quick=True, **bound),
        Case("10**16384 as a stage", ["check", "big.sched"],
             setup=make_file("big.sched", "pipeline { ranks = 2 microbatches = 2 }\n"
                         "schedule s { rank r { F(1" + "0" * 16384 + ", 0) } }\n"),
             quick=True, **bound),
        Case("integers past 64 bits by arithmetic", ["check", "mul.sched"],
             setup=make_file("mul.sched", "pipeline { ranks = 1 microbatches = 1 }\n"
                         "def sq(x, n) = sq(x * x, n - 1)\n"
                         "schedule s { rank r { let k = sq(3, 150)\n F(r, 0) B(r, 0) } }\n"),
             **bound),
        Case("a 5000-digit rank number", ["check", "rank.sched"],
             setup=make_file("rank.sched", "pipeline { ranks = 1 microbatches = 1 }\n"
                         "schedule s { rank " + "9" * 5000 + " { F(0,0) B(0,0) } }\n"),
             **bound),
        Case("a 5000-digit stage in a costs block", ["simulate", "cost.sched"],
             setup=make_file("cost.sched", "pipeline { ranks = 1 microbatches = 1 }\n"
                         "costs { stage." + "9" * 5000 + ".F = 1 }\nschedule = 1f1b\n"),
             **bound),
        Case("--set a 5000-digit micro-batch cost", ["simulate", SCHED, "--set",
                                                     "mb." + "9" * 5000 + ".F=1"], **bound),
        Case("tune --microbatches with 5000 digits",
             ["tune", "--costs", COSTS, "--microbatches", "9" * 5000], **bound),
        Case("bubble --ranks with 5000 digits", ["bubble", "--ranks", "9" * 5000], **bound),
        Case("torch CSV with a 5000-digit stage", ["check", "huge.csv"],
             setup=make_file("huge.csv", "9" * 5000 + "F0\n"), **bound),
        Case("torch CSV 0F99999999999999999999", ["check", "huge.csv"],
             setup=make_file("huge.csv", "0F99999999999999999999\n"), **bound),
        Case("torch CSV 999999999F0", ["check", "huge.csv"],
             setup=make_file("huge.csv", "999999999F0\n"), quick=True, **bound),
        Case("import-torch 999999999F0", ["import-torch", "huge.csv"],
             setup=make_file("huge.csv", "999999999F0\n"), **bound),
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
        setup = make_csv("in.csv") if head[0] == "import-torch" else None
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
                        make_file("edited.sched", data.decode("latin-1")), quick=i < 2))
    return out


