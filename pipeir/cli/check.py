"""pipeirc check: verify schedules (completeness, placement, deadlock freedom, memory)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from pipeir import driver, memunit
from pipeir.cli.common import (
    activations_or_bytes,
    add_schedule_args,
    overrides,
    schedule_ref,
    show,
)
from pipeir.cli.simulate import add_costs_arg
from pipeir.diagnostics import EXIT_OK, Diagnostic, PipeirError, UsageError
from pipeir.sim import CostModel
from pipeir.sim.cost_settings import SIZE_KEYS
from pipeir.verify import verify

ORDER = 10
NAME = "check"
HELP = "verify schedules: every op once, on its rank, no deadlock, within memory_limit"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p, many=True)
    p.add_argument("--memory-limit", type=activations_or_bytes, metavar="K",
                   help=f"{memunit.HELP}; {memunit.SPLIT_HELP} (overrides the file's "
                        "memory_limit); or bytes of "
                        "saved activations with a unit (8GB, 512MiB, 3e8B; needs "
                        "memory_bytes: in --costs, the file's costs block or --set)")
    add_costs_arg(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    p.add_argument("--lowered", action="store_true",
                   help="also lower each schedule and prove its communication deadlock-free "
                        "(rendezvous, per-peer FIFO); FILE may also be a lowered .json, or "
                        "the directory `compile -o DIR` wrote (its lowered.json)")


def run(args: argparse.Namespace) -> int:
    """Check each input on its own, so one bad file does not hide the verdict on the others;
    the exit code is the worst one (2 usage > 1 invalid > 0)."""
    import sys

    status = EXIT_OK
    for f in args.files or [None]:
        try:
            lines = _check_one(args, f)
        except PipeirError as e:
            print(e.render(), file=sys.stderr)
            status = max(status, e.exit_code)
            continue
        if not args.quiet:
            print("\n".join(lines))
    return status


def _check_one(args: argparse.Namespace, f: str | None) -> list[str]:
    if args.lowered and f is not None and Path(f, "lowered.json").is_file():
        f = str(Path(f, "lowered.json"))  # the directory `compile -o DIR` wrote
    kind = f.lower() if f is not None else ""
    if kind.endswith(".json"):  # `compile -o DIR` writes DIR/lowered.json
        if not args.lowered:
            raise UsageError(f"{f}: check reads .sched files and torch .csv files; a .json is "
                             f"a compiled program (check it with --lowered) or a cost file "
                             f"(give it to --costs)")
        from pipeir.backend.commcheck import check_json

        _refuse_flags(args, str(f), csv=False)
        return [check_json(str(f))]
    if kind.endswith(".csv"):  # torch.distributed.pipelining schedules
        from pipeir.interop.check import check_csv

        _refuse_flags(args, str(f), csv=True)
        return check_csv(str(f), memory_limit=None if args.memory_limit is None else
                         args.memory_limit.count,
                         microbatches=args.microbatches, lowered=args.lowered)
    ref = replace(schedule_ref(args), files=(f,) if f is not None else ())
    sets = overrides(args)
    where = f if f is not None else f"--schedule {args.schedule}"
    limit: memunit.MemoryLimit | None = args.memory_limit
    in_bytes = limit is not None and limit.in_bytes
    sizes: CostModel | None = None
    # a cost in --set (F=1.5, stage.0.memory_bytes=...) is read as simulate reads it
    if in_bytes or args.costs or any(map(driver.is_cost_setting, sets)):
        loaded = driver.load_with_costs(ref, sets, args.costs)
        show(loaded.warnings)
        elab, sizes = loaded.elaborated, loaded.costs
        if not sizes.knows_memory:
            if in_bytes or args.costs:
                raise UsageError("peak bytes need activation sizes: give memory_bytes in the "
                                 "costs")
            sizes = None  # costs set with --set only: nothing here is measured in bytes
    else:
        try:
            elab = driver.load_schedules(ref, sets)[0]
        except UsageError as e:  # an unknown --set may be a misspelt cost, as in simulate
            raise driver.with_cost_names(e, sets) from None
        if any(k.endswith("memory_w_bytes") for k in elab.costs):
            # the file's own costs say what W keeps after I: activations count with it, as
            # tune and synth counted them when they wrote the file
            sizes = driver.costs_for(elab, None)
    s = elab.schedule
    timed = [k for k in sets if driver.is_cost_setting(k) and k.split(".")[-1] not in SIZE_KEYS]
    show(Diagnostic(f"--set {k}: check counts memory, not time: this cost changes nothing here "
                    f"(sizes such as memory_bytes do)", severity="warning") for k in timed)
    report = verify(s, memory_limit=None if limit is None else limit.count, sizes=sizes,
                    memory_limit_bytes=None if limit is None else limit.bytes)
    c = s.config
    lines = [f"{where}: ok: {s.name}: {c.ranks} ranks, {c.stages} stages, "
             f"{c.microbatches} micro-batches, {len(s)} ops; peak in-flight "
             f"activations per rank: {' '.join(f'{x:g}' for x in report.peak_activations)}"]
    if report.peak_bytes is not None:
        lines[0] += f"; peak bytes per rank: {' '.join(f'{b:.4g}' for b in report.peak_bytes)}"
    if args.lowered:
        from pipeir.backend.commcheck import check_schedule

        lines.append(f"{where}: {check_schedule(s)}")
    return lines


def _refuse_flags(args: argparse.Namespace, f: str, csv: bool) -> None:
    """A torch schedule CSV (`csv`) or a lowered .json fixes its ranks, stages and placement
    itself and holds no settings or costs: a flag that would change them is an error, as it
    is with a .sched FILE, never silently ignored. A CSV takes --microbatches (the README's
    `check gpipe.csv --microbatches 4`: the count, where the file does not show it) and a
    --memory-limit in activations; lowered programs take neither (only their communication is
    proved)."""
    if args.schedule is not None:
        raise UsageError("give either FILE or --schedule, not both")
    noun = "a torch schedule CSV" if csv else "lowered programs"
    sizes = ("whose rows and cells give its ranks, stages and placement" if csv else
             "whose header gives their ranks, stages, micro-batches and placement")
    for flag in ("ranks", "v") if csv else ("ranks", "microbatches", "v"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} goes with --schedule; {f} is {noun}, {sizes}")
    if args.overrides:
        name = args.overrides[0].split("=", 1)[0].strip()
        hint = "; use --microbatches N" if csv and name == "microbatches" else ""
        raise UsageError(f"--set {name}: {f} is {noun}, which {'has' if csv else 'have'} no "
                         f"settings or costs to set{hint}")
    if not csv and (args.costs or args.memory_limit is not None):
        flag = "--costs" if args.costs else "--memory-limit"
        raise UsageError(f"{flag}: {f} is {noun}: check --lowered proves their "
                         "communication, not their memory; check the .sched file instead")
    if args.costs:
        raise UsageError(f"--costs: {f} is {noun}, whose memory is counted in activations, "
                         "not bytes; leave --costs out (--memory-limit K bounds activations)")
    if args.memory_limit is not None and args.memory_limit.in_bytes:
        raise UsageError(f"--memory-limit in bytes needs costs, and {f} is {noun}, whose "
                         "memory is counted in activations; use --memory-limit K (a count)")
