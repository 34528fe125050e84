"""pipeirc check: verify schedules (completeness, placement, deadlock freedom, memory)."""

from __future__ import annotations

import argparse
import copy

from pipeir.cli.common import add_schedule_args, load_schedules, memory_limit
from pipeir.cli.simulate import add_costs_arg, load_with_costs
from pipeir.diagnostics import EXIT_OK, PipeirError, UsageError
from pipeir.verify import verify

ORDER = 10
NAME = "check"
HELP = "verify schedules: every op once, on its rank, no deadlock, within memory_limit"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p, many=True)
    p.add_argument("--memory-limit", type=memory_limit, metavar="K",
                   help="most in-flight activations per rank (overrides the file's), or bytes "
                        "of saved activations with a unit (8GB, 512MiB, 3e8B; needs --costs "
                        "or a costs block with memory_bytes)")
    add_costs_arg(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    p.add_argument("--lowered", action="store_true",
                   help="also lower each schedule and prove its communication deadlock-free "
                        "(rendezvous, per-peer FIFO); FILE may also be a lowered .json")


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
    if f is not None and f.endswith(".json"):  # `compile -o DIR` writes DIR/lowered.json
        if not args.lowered:
            raise UsageError(f"{f}: a .json file is a lowered program; check it with --lowered")
        from pipeir.backend.commcheck import check_json

        return [check_json(f)]
    if f is not None and f.endswith(".csv"):  # torch.distributed.pipelining schedules
        from pipeir.interop.check import check_csv

        return check_csv(f, memory_limit=args.memory_limit, microbatches=args.microbatches,
                         lowered=args.lowered)
    one = copy.copy(args)
    one.files = [f] if f is not None else []
    s = load_schedules(one)[0].schedule
    where = f if f is not None else f"--schedule {args.schedule}"
    limit = args.memory_limit
    sizes = None
    if isinstance(limit, float) or args.costs:
        sizes = load_with_costs(one)[1]
        if not sizes.knows_memory:
            raise UsageError("peak bytes need activation sizes: give memory_bytes in the costs")
    report = verify(s, memory_limit=limit if isinstance(limit, int) else None, sizes=sizes,
                    memory_limit_bytes=limit if isinstance(limit, float) else None)
    c = s.config
    lines = [f"{where}: ok: {s.name}: {c.ranks} ranks, {c.stages} stages, "
             f"{c.microbatches} micro-batches, {len(s)} ops; peak in-flight "
             f"activations per rank: {' '.join(map(str, report.peak_activations))}"]
    if report.peak_bytes is not None:
        lines[0] += f"; peak bytes per rank: {' '.join(f'{b:.4g}' for b in report.peak_bytes)}"
    if args.lowered:
        from pipeir.backend.commcheck import check_schedule

        lines.append(f"{where}: {check_schedule(s)}")
    return lines
