"""What every `pipeirc` command shares: how a schedule is named on the command line (FILE,
or `--schedule NAME` from the library) and how `--set name=value` is read."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import sys
from collections.abc import Iterable, Iterator

from pipeir import driver, limits
from pipeir.argtypes import positive_float, positive_int
from pipeir.diagnostics import Diagnostic, UsageError
from pipeir.driver import ScheduleRef
from pipeir.files import write_atomic
from pipeir.frontend.elaborate import Elaborated, Value
from pipeir.memunit import MemoryLimit
from pipeir.runtime import devices


def add_schedule_args(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    """FILE (or FILE... when `many`), or a library schedule by name, plus --set."""
    p.add_argument("files", nargs="*" if many else "?", metavar="FILE",
                   help=".sched files" if many else "a .sched file")
    lib = p.add_argument_group("library schedule (instead of FILE)")
    lib.add_argument("--schedule", metavar="NAME", help="library schedule, e.g. 1f1b")
    lib.add_argument("--ranks", type=int, metavar="P")
    lib.add_argument("--microbatches", type=int, metavar="M")
    lib.add_argument("--v", type=positive_int, metavar="V",
                     help="chunks per rank (interleaved)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   dest="overrides", help="override a pipeline setting or schedule parameter")


def add_device_arg(p: argparse.ArgumentParser, what: str) -> None:
    """--device, for the commands that run or time a model (`pipeir.runtime.devices`)."""
    p.add_argument("--device", choices=devices.MODES,
                   help=f"where {what}: auto (default: CUDA, with NCCL between ranks, where "
                        "this host has a CUDA device per rank; else CPU with gloo), cpu, or "
                        f"cuda (an error without a device per rank); sets {devices.ENV}")


@contextlib.contextmanager
def device_env(args: argparse.Namespace) -> Iterator[None]:
    """--device in the environment the ranks (and this process) read while the command runs,
    restored after it (a caller of `pipeir.cli.main` keeps its own); a bad `PIPEIR_DEVICE`
    from the shell is a usage error here, not in every rank."""
    before = os.environ.get(devices.ENV)
    if args.device is not None:
        os.environ[devices.ENV] = args.device
    try:
        try:
            devices.mode()
        except ValueError as e:
            raise UsageError(str(e)) from None
        yield
    finally:
        if before is None:
            os.environ.pop(devices.ENV, None)
        else:
            os.environ[devices.ENV] = before


def activations_or_bytes(text: str) -> MemoryLimit:
    """argparse type: a positive number of activations (`4`, `3.5`), or bytes with a unit
    (`8GB`, `512MiB`, `3e8B`): every command's memory budget (`check`, `tune`, `plan`)."""
    num, unit = limits.split_unit(text)
    if unit:
        return MemoryLimit(_bytes(text, num, unit), True, text)
    return MemoryLimit(positive_float(text), False, text)


def byte_size(text: str) -> float:
    """argparse type: a positive number of bytes, plain (`3e8`) or with a unit (`8GB`)."""
    num, unit = limits.split_unit(text)
    return _bytes(text, num, unit) if unit else positive_float(text)


def _bytes(text: str, num: str, unit: str) -> float:
    try:
        value = limits.bytes_of(num, unit)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a count or bytes with a unit ({', '.join(limits.BYTE_UNITS)}), got "
            f"{text!r}") from None
    if not 0 < value < math.inf:  # (infB was an infinite budget; nanB is refused too)
        raise argparse.ArgumentTypeError(f"expected a positive, finite size, got {text!r}")
    return value

#: The widest text picture drawn: the timeline is built in memory a column at a time, so a
#: width of 10^8 took minutes and gigabytes before any check.
MAX_COLUMNS = 10_000


def columns(text: str) -> int:
    """argparse type: a picture's width, 10 to `MAX_COLUMNS` columns."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of columns, got {text!r}") from None
    if not 10 <= value <= MAX_COLUMNS:
        raise argparse.ArgumentTypeError(f"expected 10 to {MAX_COLUMNS:,} columns, got {value}")
    return value


def positive_ints(flag: str, text: str) -> list[int]:
    """`--microbatches 8,16`: positive integers (of 64 bits) separated by commas."""
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = limits.to_int(part) if part.isdigit() else 0
        except ValueError as e:
            raise UsageError(f"{flag}: {e}") from None
        if value < 1:
            raise UsageError(f"{flag} {text!r}: expected positive integers separated by "
                             f"commas, got '{part}'" if not text.strip() else
                             f"{flag} {text}: expected positive integers separated by commas, "
                             f"got '{part}'")
        out.append(value)
    return out


def parse_override(text: str) -> tuple[str, Value]:
    """`--set name=value`: value is an integer, a number, a name (loop, vshape) or a list."""
    if "=" not in text:
        raise UsageError(f"--set {text}: expected NAME=VALUE")
    name, raw = (x.strip() for x in text.split("=", 1))
    return name, _literal(raw, f"--set {text}")


def _literal(raw: str, where: str) -> Value:
    if raw in ("true", "false"):
        return raw == "true"
    if raw.startswith("[") and raw.endswith("]"):
        inner = raw[1:-1].strip()
        return tuple(_literal(x.strip(), where) for x in inner.split(",")) if inner else ()
    for conv in (int, float):
        try:
            value = conv(raw)
        except ValueError:
            continue
        if not raw.isascii():  # (Python reads '٣' as 3; a .sched file does not)
            raise UsageError(f"{where}: write the number in ASCII digits, as a .sched file "
                             f"does")
        return value
    if raw.isidentifier():
        return raw
    raise UsageError(f"{where}: cannot read '{raw}' (expected an integer, a number, a name "
                     "or a list [a, b, ...])")


def emit_schedule(text: str, output: str | None) -> None:
    """A `.sched` text to `-o FILE` (atomically, then the one line saying so, as compile, tune
    and synth print for theirs: silence after a write left users unsure anything was
    written), or to stdout."""
    if output is None:
        print(text, end="")
        return
    write_atomic(output, text, "-o")
    print(f"wrote {output} (pipeirc simulate {shlex.quote(output)})")


def schedule_ref(args: argparse.Namespace) -> ScheduleRef:
    """What FILE (or FILE...) or `--schedule NAME --ranks P --microbatches M [--v V]` names."""
    files = args.files if isinstance(args.files, list) else [args.files] if args.files else []
    return ScheduleRef(tuple(files), args.schedule, args.ranks, args.microbatches, args.v)


def overrides(args: argparse.Namespace) -> dict[str, Value]:
    """`--set NAME=VALUE`, every one of them read (the last of a name wins)."""
    out: dict[str, Value] = {}
    for text in args.overrides:
        k, v = parse_override(text)
        out[k] = v
    return out


def show(warnings: Iterable[Diagnostic]) -> None:
    """Print the driver's warnings to stderr, where every command's diagnostics go."""
    for d in warnings:
        print(d.render(), file=sys.stderr)


def load_one(args: argparse.Namespace) -> Elaborated:
    """The schedule the command line names, for commands that take no costs."""
    return driver.load_schedules(schedule_ref(args), overrides(args))[0]


def load_with_costs(args: argparse.Namespace) -> driver.Loaded:
    """The schedule the command line names with its costs (`--costs`, `--set F=...`); the
    driver's warnings are printed."""
    loaded = driver.load_with_costs(schedule_ref(args), overrides(args), args.costs)
    show(loaded.warnings)
    return loaded
