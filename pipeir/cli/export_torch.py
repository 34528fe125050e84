"""pipeirc export-torch: a schedule as the CSV torch.distributed.pipelining loads."""

from __future__ import annotations

import argparse

from pipeir.cli.common import add_schedule_args, load_one
from pipeir.diagnostics import EXIT_OK
from pipeir.files import write_atomic
from pipeir.interop.writer import FORMATS, dumps_csv

ORDER = 130
NAME = "export-torch"
HELP = "write a schedule as a torch.distributed.pipelining CSV (_PipelineScheduleRuntime._load_csv)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    p.add_argument("-o", "--output", metavar="OUT.csv", help="write to OUT instead of stdout")
    p.add_argument("--format", choices=FORMATS, default="compute_only",
                   help="compute_only (torch adds communication when it loads the file) or "
                        "compute_comms (SEND/RECV placed as torch's _add_send_recv places them); "
                        "default: %(default)s")


def run(args: argparse.Namespace) -> int:
    if isinstance(args.files, str) and args.files.endswith(".csv"):
        from pipeir.interop.reader import load_csv

        if args.schedule is not None:
            from pipeir.diagnostics import UsageError

            raise UsageError("give either FILE or --schedule, not both")
        schedule = load_csv(args.files).schedule
    else:
        schedule = load_one(args).schedule
    text = dumps_csv(schedule, args.format)
    if args.output is not None:
        write_atomic(args.output, text, "-o")
        print(f"wrote {args.output} ({args.format} CSV for torch.distributed.pipelining: "
              f"{schedule.config.ranks} ranks, {schedule.config.microbatches} micro-batches)")
    else:
        print(text, end="")
    return EXIT_OK
