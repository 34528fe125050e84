"""One resource policy: how much memory and work one input may ask of pipeir, checked before
the work is done, at every entrance (`.sched` files, torch CSVs, cost files, command-line
sizes, pass outputs, lowering).

NOTE (where the numbers come from): peak resident memory (GNU time's %M) of `pipeirc` on
CPython 3.11, x86-64, at commit 03cbf00; the interpreter and pipeir's imports take ~44 MB.
- A schedule costs ~1.9 KB per op (graph node and edges, span, program slot, op object):
  `check --schedule 1f1b --ranks 64` peaks at 164 MB with 512 micro-batches (65,536 ops)
  and 287 MB with 1,024 (131,072 ops). BYTES_PER_OP rounds that up to 2,000.
- Lowering costs ~5 KB per op and round (the schedule, four to five instructions per op, the
  communication proof, the generated files): `compile -o DIR` of interleaved 1F1B at p=16,
  v=4 peaks at 127 MB with 128 micro-batches (16,384 ops) and 206 MB with 256 (32,768 ops):
  4.9 KB per op. BYTES_PER_LOWERED_OP rounds that up to 5,500. `accumulate = k` lowers k
  rounds, so it multiplies the count.
- Parsing costs ~400 B per byte of dense `.sched` text (Lark's tree and tokens): the printed
  32-rank, 256-micro-batch 1F1B (167 KB) peaks at 109 MB.
- Reading a lowered.json (`check --lowered`, a compiled program's main.py) costs ~5 to 7 B per
  byte (json's lists, then the instructions; the file is a table of short rows, about 60 bytes
  an instruction): `check --lowered` of that p=16 program's 4.2 MiB file peaks at 74 MB, 30 MB
  over the interpreter and imports, and of the p=32, m=256 one's 17.5 MiB at 132 MB.
  BYTES_PER_JSON_BYTE rounds that up to 8.
Every size limit is the memory budget divided by one of these costs, so the one variable
PIPEIR_MAX_MEMORY (default 2 GiB) raises them all: by default a schedule may hold 1,073,741
ops (p=64, v=4, m=512 split into F/I/W is 393,216), lowering 390,451 ops x rounds, an
input file 5 MiB and a lowered.json 256 MiB. `tune` keeps every candidate it simulates (its
table ranks them all), so the ops of its whole search count together (`tune.search`: its
default search at p=32, m=128 holds 966,656 ops and peaks at 1.55 GB).

Training (`pipeirc run`) is bounded by what the machine has, not by the budget: before any
process starts, the weights, gradients, buffers and optimizer state of every stage are counted
exactly on fake tensors (`ShapePlan.state_bytes`), plus BYTES_PER_PROCESS for each process
(max RSS after `import torch, torch.distributed`: 224 MB). That sum is a lower bound of what
the run holds before its first activation; it is compared with the host's available memory
(MemAvailable), or with PIPEIR_MAX_MEMORY when that is set.

Work that makes no ops is bounded by count, measured in time: a loop iteration of the
elaborator takes ~0.25 us (MAX_ITERATIONS = 20M is ~5 s), a call of a `def` ~2.4 us. Calls
are allowed CALLS_PER_PAIR per (stage, micro-batch) pair of the pipeline plus CALLS_BASE
(the library's schedules make at most 2 per op), so a recursion that fans out (f calling
f twice per level) stops within a second or two instead of running for hours. Integers are
64-bit: a stage, micro-batch or rank beyond that means nothing, and Python's big integers
would turn `10**16384`-sized values into slow arithmetic and unprintable messages.
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any, Final

from pipeir.diagnostics import Source, UsageError, read_bytes

#: The environment variable holding the memory budget (bytes, or with a unit: 8GiB, 500MB).
ENV: Final = "PIPEIR_MAX_MEMORY"
DEFAULT_BUDGET: Final = 2 * 2**30

BYTES_PER_OP: Final = 2_000
BYTES_PER_LOWERED_OP: Final = 5_500
BYTES_PER_INPUT_BYTE: Final = 400
BYTES_PER_JSON_BYTE: Final = 8

BYTES_PER_PROCESS: Final = 224 * 10**6

MAX_ITERATIONS: Final = 20_000_000
MAX_DEPTH: Final = 200
CALLS_PER_PAIR: Final = 8
CALLS_BASE: Final = 100_000
MAX_INT: Final = 2**63 - 1

#: Past this much memory no budget helps: the input is wrong, not large.
_ABSURD: Final = 2**50

#: Units of a size written with one (`8GB`, `512MiB`, `3e8B`).
BYTE_UNITS: Final = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                     "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def split_unit(text: str) -> tuple[str, str]:
    """`"8GiB"` -> `("8", "GIB")`: the number and its unit (upper case; "" for none)."""
    t = text.strip()
    num = t.rstrip("BbKkMmGgTtIi")
    return num, t[len(num):].upper()


def bytes_of(num: str, unit: str) -> float:
    """The bytes `num` `unit` stand for; ValueError for an unknown unit or a bad number."""
    if unit not in BYTE_UNITS:
        raise ValueError(unit)
    return float(num) * BYTE_UNITS[unit]


def budget() -> int:
    """The memory budget in bytes: PIPEIR_MAX_MEMORY, else DEFAULT_BUDGET."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_BUDGET
    num, unit = split_unit(raw)
    try:
        value = bytes_of(num, unit or "B")
    except ValueError:
        value = -1.0
    if not 1 <= value < 2**63:
        raise UsageError(f"{ENV}={raw}: expected a size such as 8GiB, 500MB or 4000000000")
    return int(value)


def max_ops() -> int:
    """The most ops one schedule may hold."""
    return budget() // BYTES_PER_OP


def max_lowered_ops() -> int:
    """The most ops x rounds one lowering may handle."""
    return budget() // BYTES_PER_LOWERED_OP


def max_input_bytes() -> int:
    """The longest input file pipeir reads."""
    return budget() // BYTES_PER_INPUT_BYTE


def binary_unit(n: float) -> tuple[str, int]:
    """The binary unit to show `n` bytes in, and its size: ("GiB", 2**30) for 3e9."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return unit, scale
    return "B", 1


def _size(n: float) -> str:
    if n > _ABSURD:
        return "more than 1 PiB"
    unit, scale = binary_unit(min(n, 2**40 - 1))  # (messages stop at GiB, as before)
    return f"{n / scale:.3g} {unit}" if scale > 1 else f"{n:.0f} B"


def _raise_to(need: float) -> str:
    """How to allow `need` bytes: PIPEIR_MAX_MEMORY in whole GiB, rounded up."""
    if need > _ABSURD:
        return f"no {ENV} allows that much; is a number wrong?"
    return f"to allow it, set {ENV}={max(1, -(-int(need) // 2**30))}GiB"


def over(what: str, count: int, unit: str, per: int) -> str | None:
    """The message for `count` units (`unit` names one, e.g. "ops") costing `per` bytes each
    against the budget, or None when they fit."""
    have = budget()
    if count <= have // per:
        return None
    need = count * per
    shown = f"{count:,}" if count < 10**30 else "more than 10^30"
    return (f"{what} is too large: {shown} {unit} need {_size(need)} (~{per:,} B each), "
            f"over pipeir's memory budget of {_size(have)}; {_raise_to(need)}")


def check(what: str, count: int, unit: str, per: int) -> None:
    """Raise a UsageError when `count` units of `per` bytes exceed the budget."""
    message = over(what, count, unit, per)
    if message is not None:
        raise UsageError(message)


def check_ops(what: str, ops: int) -> None:
    """A schedule of `ops` ops (from a file, a CSV, a pass, expanded rounds) fits the budget."""
    check(what, ops, "ops", BYTES_PER_OP)


def check_lowering(what: str, ops: int, rounds: int) -> None:
    """Lowering `ops` ops for `rounds` rounds (`accumulate`) fits the budget."""
    check(what, ops * rounds, "ops x rounds" if rounds > 1 else "ops", BYTES_PER_LOWERED_OP)


def to_int(digits: str) -> int:
    """A string of decimal digits as an integer of the 64-bit range, else a ValueError that
    says so (Python's own int() refuses past 4,300 digits with advice about sys)."""
    significant = digits.lstrip("0") or "0"
    if len(significant) > len(str(MAX_INT)) or int(significant) > MAX_INT:
        shown = digits if len(digits) < 30 else digits[:12] + "..."
        raise ValueError(f"integer {shown} ({len(digits)} digits) is out of range: integers "
                         f"are 64-bit, at most {MAX_INT:,}")
    return int(significant)


def plain_number(v: Any) -> Any:
    """A number of another library (numpy's int64 or float64) as Python's own int or float,
    so that it prints, hashes and is type-checked as one; anything else as it is."""
    if type(v) in (int, float) or isinstance(v, bool) or not isinstance(v, numbers.Real):
        return v
    return int(v) if isinstance(v, numbers.Integral) else float(v)


def int_overflow(value: int) -> bool:
    """Whether an integer is outside the language's 64-bit range."""
    return not -MAX_INT <= value <= MAX_INT


def read_input(path: str | os.PathLike[str], kind: str,
               per_byte: int = BYTES_PER_INPUT_BYTE) -> Source:
    """Read a user's text file (`kind` names it in messages), at most the budget over
    `per_byte` (the memory one byte of it costs; default: parsed text, `max_input_bytes()`):
    `/dev/zero` or a huge file is refused after reading one byte past the limit."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"expected the path of a {kind}, got {type(path).__name__}")
    most = budget() // per_byte
    data = read_bytes(Path(path), kind, most)
    if len(data) > most:
        raise UsageError(f"{path}: longer than {_size(most)}, the most pipeir reads as a "
                         f"{kind} (~{per_byte} B of memory per byte of "
                         f"{_size(budget())}); "
                         f"{_raise_to(float(len(data)) * per_byte * 2)}")
    return Source.decode(path, data, kind)


def _available() -> int | None:
    """The host's available memory (MemAvailable), or None where /proc/meminfo does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_training(per_rank: list[int], stages_per_rank: list[int], replicas: int,
                   on_host: bool = True) -> None:
    """The training processes of one machine fit its memory: `per_rank[r]` bytes of state for
    pipeline rank r (each of `replicas` data-parallel copies holds the same), plus the cost of a
    process. Raise a UsageError naming the largest rank otherwise. `on_host` False: the ranks
    keep their state on CUDA devices, so only the processes count here (a device that is too
    small says so itself, naming the allocation)."""
    processes = len(per_rank) * replicas
    state = replicas * sum(per_rank) if on_host else 0
    need = state + processes * BYTES_PER_PROCESS
    if os.environ.get(ENV, "").strip():
        have, where = budget(), f"pipeir's memory budget ({ENV})"
    else:
        avail = _available()
        if avail is None:
            return
        have, where = avail, "this machine's available memory"
    if need <= have:
        return
    r = max(range(len(per_rank)), key=per_rank.__getitem__)
    raise UsageError(
        f"training needs at least {_size(need)} of memory: {processes} processes, each "
        f"~{_size(BYTES_PER_PROCESS)} for torch plus its stages' weights, gradients and "
        f"optimizer state (rank {r}: {stages_per_rank[r]:,} stages, {_size(per_rank[r])}), "
        f"over {where} of {_size(have)}; use fewer stages or a smaller model, or "
        f"{_raise_to(need).removeprefix('to allow it, ')} to try anyway")
