"""What every `pipeirc` command shares: how a schedule is named on the command line (FILE,
or `--schedule NAME` from the library) and how `--set name=value` is read."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from pipeir import library, limits
from pipeir.api import load
from pipeir.argtypes import positive_int
from pipeir.diagnostics import Note, Source, UsageError
from pipeir.frontend.elaborate import Elaborated, Value
from pipeir.passes.context import costless_message
from pipeir.sim.cost_settings import TOP_KEYS

if TYPE_CHECKING:
    from pipeir.passes.base import PassBase
    from pipeir.sim.costs import CostModel


def add_schedule_args(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    """FILE (or FILE... when `many`), or a library schedule by name, plus --set."""
    p.add_argument("files", nargs="*" if many else "?", metavar="FILE",
                   help="a .sched file" + ("s" if many else ""))
    lib = p.add_argument_group("library schedule (instead of FILE)")
    lib.add_argument("--schedule", metavar="NAME", help="library schedule, e.g. 1f1b")
    lib.add_argument("--ranks", type=int, metavar="P")
    lib.add_argument("--microbatches", type=int, metavar="M")
    lib.add_argument("--v", type=positive_int, metavar="V",
                     help="chunks per rank (interleaved)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   dest="overrides", help="override a pipeline setting or schedule parameter")


def memory_limit(text: str) -> int | float:
    """argparse type: a positive count of activations (int), or bytes written with a unit
    (`8GB`, `512MiB`, `3e8B`: a float)."""
    num, unit = limits.split_unit(text)
    if not unit:
        return positive_int(text)
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
            return conv(raw)
        except ValueError:
            pass
    if raw.isidentifier():
        return raw
    raise UsageError(f"{where}: cannot read '{raw}' (expected an integer, a number, a name "
                     "or a list [a, b, ...])")





def wrote_schedule(path: str) -> None:
    """The one line a command that writes a `.sched` with -o prints (as compile, tune and
    synth do for theirs): silence after a write left users unsure anything was written."""
    print(f"wrote {path} (pipeirc simulate {shlex.quote(path)})")


def warn_shadowed(names: Iterable[str]) -> None:
    """Warn (stderr) when a pass the command runs is also claimed by an installed plugin,
    which is ignored: the user may believe the plugin runs."""
    from pipeir.passes import registry

    shadowed = registry.shadowed_plugins()
    for name in dict.fromkeys(names):
        if name in shadowed:
            print(f"warning: {registry.shadow_warning(name, shadowed[name])}", file=sys.stderr)


def warn_fewer_stages(where: str, known: int | None, ranks: int) -> None:
    """Warn (stderr) when --ranks asks for more stages than the cost file describes: the
    stages past its last `[stage.K]` take the file's defaults, and its last stage (often the
    LM head and loss) becomes a middle one."""
    if known is not None and ranks > known:
        print(f"warning: {where} describes {known} stages (stage.{known - 1}.* is the last "
              f"set) but --ranks is {ranks}: stages {known} to {ranks - 1} take the file's "
              "defaults", file=sys.stderr)


#: The most processes: torch.distributed numbers ranks with 32-bit integers.
MAX_WORLD = 2**31 - 1


def check_replicas(ranks: int, dp: int) -> None:
    """--dp D for a P-rank pipeline: at least one replica, and P x D processes that
    torch.distributed can number (compile, run and tune)."""
    if dp < 1:
        raise UsageError(f"--dp {dp}: need at least 1 replica")
    if ranks * dp > MAX_WORLD:
        raise UsageError(f"--dp {dp}: {ranks} ranks x {dp:,} replicas is {ranks * dp:,} "
                         "processes; torch.distributed numbers them with 32-bit integers (at "
                         f"most {MAX_WORLD:,})")


def check_mb_costs(costs: CostModel, microbatches: int) -> None:
    """Per-micro-batch costs (`[mb.K]`) for more micro-batches than `--microbatches`: a
    UsageError (tune and synth; simulate, with a schedule of its own, warns). Ignored, they
    made every micro-batch look unequal, and tune put `reorder` on every candidate."""
    if costs.mb or costs.stage_mb:
        given = max([*costs.mb, *(m for _, m in costs.stage_mb)]) + 1
        if given > microbatches:
            raise UsageError(f"the costs give per-micro-batch times for {given} micro-batches "
                             f"but --microbatches is {microbatches}")


def warn_costless(passes: Iterable[PassBase], costs: Mapping[str, object]) -> None:
    """Warn (stderr) when a pass that decides by cost runs with no costs at all (no --costs,
    no costs block, no cost in --set): it then plans for the default unit costs, which is
    rarely what was meant."""
    if costs:
        return
    for name in dict.fromkeys(p.name for p in passes if p.costed):
        print(f"warning: {costless_message(name, 'give --costs FILE or a costs block')}",
              file=sys.stderr)


def is_cost_setting(name: str) -> bool:
    """Whether a --set name is a cost (F, stage.2.F, latency, ...), not a pipeline setting."""
    return name in TOP_KEYS or name.startswith(("stage.", "mb."))


def _overrides(args: argparse.Namespace) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for text in args.overrides:
        k, v = parse_override(text)
        out[k] = v
    return out


def load_schedules(args: argparse.Namespace) -> list[Elaborated]:
    """Every schedule the command line names, elaborated (files first, in order). Commands
    that take costs have taken theirs out of --set already (`load_with_costs`), so a cost
    name that is no setting here is one the command has no use for, and it says so."""
    try:
        return _load_schedules(args)
    except UsageError as e:
        for text in args.overrides:
            k = text.split("=", 1)[0].strip()
            if is_cost_setting(k) and e.message.startswith(f"--set {k}: unknown setting"):
                raise UsageError(f"--set {text}: '{k}' is a cost, and this command uses none "
                                 "(simulate, plot, check, print, opt, compile and run take "
                                 "costs)") from None
        raise


def _load_schedules(args: argparse.Namespace) -> list[Elaborated]:
    files = args.files if isinstance(args.files, list) else [args.files] if args.files else []
    overrides = _overrides(args)
    if args.schedule is not None:
        if files:
            raise UsageError("give either FILE or --schedule, not both")
        if args.ranks is None or args.microbatches is None:
            raise UsageError("--schedule needs --ranks P and --microbatches M")
        found = library.require(args.schedule)
        kw: dict[str, Value] = {}
        if args.v is not None:
            if "v" not in found.params:
                raise UsageError(f"--v: library schedule '{found.name}' has no chunks parameter v")
            kw["v"] = args.v
        for flag in ("ranks", "microbatches", "v"):
            if flag in overrides and getattr(args, flag) is not None:
                raise UsageError(f"--set {flag}=... and --{flag} disagree about who decides; "
                                 "give one of them")
        overrides.update(ranks=args.ranks, microbatches=args.microbatches)
        return [library.instantiate(found, overrides, kw)]
    if not files:
        raise UsageError("no schedule given: pass a .sched FILE, or --schedule NAME "
                         "--ranks P --microbatches M")
    for flag in ("ranks", "microbatches", "v"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} goes with --schedule; with a FILE, use --set {flag}=N")
    for f in files:
        if not isinstance(f, Source) and str(f).lower().endswith(".csv"):
            raise UsageError(f"{f}: this is a torch schedule CSV: use `pipeirc import-torch "
                             f"{f} -o FILE.sched` first (check and export-torch read it too)")
        if not isinstance(f, Source):
            library_name(str(f))
    return [load(f if isinstance(f, Source) else Path(f), overrides=overrides) for f in files]


def library_name(f: str) -> None:
    """FILE that is no file but names a library schedule (`pipeirc run 1f1b`): the error
    shows the flags that name it, which a first-time user cannot guess from "no such file"."""
    found = library.find(f) if not Path(f).exists() else None
    if found is not None:
        v = " --v V" if "v" in found.params else ""
        raise UsageError(f"{f}: no such .sched file", notes=(Note(
            f"'{found.name}' is a library schedule: use --schedule {found.name} --ranks P "
            f"--microbatches M{v}"),))


def load_one(args: argparse.Namespace) -> Elaborated:
    return load_schedules(args)[0]
