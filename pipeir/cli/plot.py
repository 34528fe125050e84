"""pipeirc plot: a Gantt chart of a simulated schedule, as PNG, SVG or PDF (needs matplotlib)."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeir.cli.common import add_schedule_args
from pipeir.cli.simulate import add_cost_args, simulate_args
from pipeir.diagnostics import UsageError
from pipeir.files import resolve_output, write_atomic
from pipeir.views.plot import FORMATS

ORDER = 50
NAME = "plot"
HELP = "draw the simulated timeline as a Gantt chart (png, svg or pdf; needs matplotlib)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    add_cost_args(p)
    p.add_argument("-o", "--output", metavar="OUT", required=True,
                   help="the image to write; its suffix picks the format (.png, .svg, .pdf)")
    p.add_argument("--arrows", action="store_true", help="draw an arrow for each transfer")
    p.add_argument("--title", help="chart title (default: the schedule's name)")


def run(args: argparse.Namespace) -> int:
    fmt = Path(args.output).suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise UsageError(f"-o {args.output}: cannot tell the image format; end the name in "
                         f"{', '.join('.' + f for f in FORMATS)}")
    resolve_output(args.output, "-o")
    from pipeir.views.plot import render_gantt

    result = simulate_args(args)
    write_atomic(args.output, render_gantt(result, fmt, arrows=args.arrows, title=args.title),
                 "-o")
    print(f"wrote {args.output}: makespan {result.makespan:.6g}, bubble {result.bubble:.1%}")
    return 0
