"""pipeirc check: verify schedules (completeness, placement, deadlock freedom, memory)."""

from __future__ import annotations

import argparse

from pipeir.cli.common import add_schedule_args, load_schedules
from pipeir.diagnostics import EXIT_INVALID, EXIT_OK, VerifyError
from pipeir.verify import verify

ORDER = 10
NAME = "check"
HELP = "verify schedules: every op once, on its rank, no deadlock, within memory_limit"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p, many=True)
    p.add_argument("--memory-limit", type=int, metavar="K",
                   help="most in-flight activations per rank (overrides the file's)")
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors")
    p.add_argument("--lowered", action="store_true",
                   help="also lower each schedule and prove its communication deadlock-free "
                        "(rendezvous, per-peer FIFO); FILE may also be a lowered .json")


def run(args: argparse.Namespace) -> int:
    import sys

    status = EXIT_OK
    if args.lowered:  # lowered programs (`compile -o DIR` writes DIR/lowered.json)
        from pipeir.backend.commcheck import check_json

        for f in [f for f in args.files if f.endswith(".json")]:
            try:
                line = check_json(f)
            except VerifyError as e:
                print(e.render(), file=sys.stderr)
                status = EXIT_INVALID
                continue
            if not args.quiet:
                print(line)
        args.files = [f for f in args.files if not f.endswith(".json")]
        if not args.files and args.schedule is None:
            return status
    csvs = [f for f in args.files if f.endswith(".csv")]
    if csvs:  # torch.distributed.pipelining schedules (see pipeir.frontend.torch_csv)
        from pipeir.frontend.torch_csv import check_csv

        for f in csvs:
            try:
                lines = check_csv(f, memory_limit=args.memory_limit)
            except VerifyError as e:
                print(e.render(), file=sys.stderr)
                status = EXIT_INVALID
                continue
            if not args.quiet:
                print("\n".join(lines))
        args.files = [f for f in args.files if not f.endswith(".csv")]
        if not args.files and args.schedule is None:
            return status
    labels = args.files or [f"--schedule {args.schedule}"]
    for where, elab in zip(labels, load_schedules(args)):
        s = elab.schedule
        try:
            report = verify(s, memory_limit=args.memory_limit)
        except VerifyError as e:
            print(e.render(), file=sys.stderr)
            status = EXIT_INVALID
            continue
        if args.lowered:
            from pipeir.backend.commcheck import check_schedule

            try:
                lowered_line = check_schedule(s)
            except VerifyError as e:
                print(e.render(), file=sys.stderr)
                status = EXIT_INVALID
                continue
        if not args.quiet:
            c = s.config
            print(f"{where}: ok: {s.name}: {c.ranks} ranks, {c.stages} stages, "
                  f"{c.microbatches} micro-batches, {len(s)} ops; peak in-flight "
                  f"activations per rank: {' '.join(map(str, report.peak_activations))}")
            if args.lowered:
                print(f"{where}: {lowered_line}")
    return status
