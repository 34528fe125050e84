"""pipeirc print: the canonical, loop-free `.sched` form, which re-parses to the same schedule."""

from __future__ import annotations

import argparse

from pipeir.cli.common import add_schedule_args, emit_schedule, load_with_costs
from pipeir.cli.simulate import add_costs_arg
from pipeir.printer import print_schedule

ORDER = 30
NAME = "print"
HELP = "print the explicit (loop-free) canonical form of a schedule"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    add_costs_arg(p)  # the printed form has a costs block: --costs and --set F=... fill it
    p.add_argument("-o", "--output", metavar="OUT", help="write to OUT instead of stdout")


def run(args: argparse.Namespace) -> int:
    elab = load_with_costs(args).elaborated
    text = print_schedule(elab.schedule, {k: v for k, (v, _) in elab.costs.items()})
    emit_schedule(text, args.output)
    return 0
