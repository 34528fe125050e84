"""pipeirc show: the per-rank op grid in the terminal."""

from __future__ import annotations

import argparse
import shutil

from pipeir.cli.common import add_schedule_args, columns, load_one
from pipeir.verify import verify
from pipeir.views.grid import render_grid

ORDER = 20
NAME = "show"
HELP = "print the per-rank op grid (ranks as rows, time steps as columns)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    p.add_argument("--width", type=columns, default=None,
                   help="wrap at this many columns (default: the terminal's width)")


def run(args: argparse.Namespace) -> int:
    s = load_one(args).schedule
    verify(s)  # a grid of a deadlocking schedule cannot be drawn; say why instead
    # (a tiny terminal still gets 40 columns; an explicit --width is what it says)
    width = args.width or max(40, shutil.get_terminal_size((100, 24)).columns)
    print(render_grid(s, width=width), end="")
    return 0
