"""pipeirc import-torch: a torch.distributed.pipelining schedule CSV as a canonical `.sched`."""

from __future__ import annotations

import argparse
import sys

from pipeir.cli.common import emit_schedule
from pipeir.diagnostics import EXIT_OK
from pipeir.interop import FORMATS, load_csv, prove_comms
from pipeir.printer import print_schedule
from pipeir.verify import verify

ORDER = 120
NAME = "import-torch"
HELP = "read a torch.distributed.pipelining schedule CSV and print it as a canonical .sched"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE.csv", help="a CSV as torch's _dump_csv writes it")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="micro-batches per step (default: the largest in the file + 1)")
    p.add_argument("--format", choices=("auto", *FORMATS), default="auto",
                   help="compute_only (F/B/I/W) or compute_comms (with SEND/RECV); "
                        "default: compute_comms when the file has SEND/RECV actions")
    p.add_argument("-o", "--output", metavar="OUT.sched", help="write to OUT instead of stdout")
    p.add_argument("--no-verify", action="store_true",
                   help="write the schedule even if it is invalid (to inspect it)")


def run(args: argparse.Namespace) -> int:
    imported = load_csv(args.file, microbatches=args.microbatches, format=args.format)
    if not args.no_verify:
        verify(imported.schedule)
        if imported.has_comms:
            prove_comms(imported)
    text = print_schedule(imported.schedule)
    emit_schedule(text, args.output)
    if args.output is not None and imported.has_comms:
        print(f"{args.file}: note: the communication actions were proved deadlock-free and "
              "are not part of the .sched; export-torch --format compute_comms places them "
              "again as torch does", file=sys.stderr)
    return EXIT_OK
