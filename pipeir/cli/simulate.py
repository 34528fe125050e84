"""pipeirc simulate: what a schedule costs (makespan, bubble, memory) and when each op runs."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from pipeir import driver
from pipeir.cli.common import add_schedule_args, columns, load_with_costs
from pipeir.files import resolve_output, write_atomic
from pipeir.sim import COMM_MODELS, SimResult
from pipeir.sim.steady import SteadyState, steady

ORDER = 40
NAME = "simulate"
HELP = "simulate a schedule: makespan, bubble, peak memory and an ASCII timeline"


def add_costs_arg(p: argparse.ArgumentParser) -> None:
    """--costs (cost settings in --set are read by `pipeir.driver.load_with_costs`)."""
    p.add_argument("--costs", metavar="FILE",
                   help="JSON or TOML cost file (replaces the .sched file's costs block); "
                        "--set F=1.5 and the like override single costs")


def add_cost_args(p: argparse.ArgumentParser) -> None:
    """--costs and --comm."""
    add_costs_arg(p)
    p.add_argument("--comm", choices=COMM_MODELS, default=COMM_MODELS[0],
                   help="communication model (default: %(default)s)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    add_cost_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--trace", metavar="OUT", help="write a Chrome/Perfetto trace to OUT")
    p.add_argument("--width", type=columns, default=None,
                   help="timeline width in columns (default: the terminal's width)")


def simulate_args(args: argparse.Namespace) -> SimResult:
    """Load, verify and simulate the schedule the command line names, with its costs."""
    return driver.simulate(load_with_costs(args), args.comm)


def run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        resolve_output(args.trace, "--trace")
    result = simulate_args(args)
    if args.trace is not None:
        from pipeir.views.trace import chrome_trace

        write_atomic(args.trace, json.dumps(chrome_trace(result)), "--trace")
    if args.json:
        print(json.dumps({**result.to_json(), "steady": steady_json(steady(result))}, indent=2))
        return 0
    from pipeir.views.timeline import render_timeline

    tty = sys.stdout.isatty()
    width = args.width or shutil.get_terminal_size((100, 24)).columns - 16
    color = tty and not os.environ.get("NO_COLOR")
    print(summary(result))
    print()
    print(render_timeline(result, width=max(10, width), color=color), end="")
    if args.trace is not None:
        print(f"wrote {args.trace} (open it in https://ui.perfetto.dev)")
    return 0


def summary(result: SimResult) -> str:
    """The summary table: makespan, both bubble figures, per-rank utilisation and memory."""
    s, c = result.schedule, result.schedule.config
    unit = f" {result.costs.unit}" if result.costs.unit else ""
    lines = [f"{s.name}: {c.ranks} ranks, {c.stages} stages, {c.microbatches} micro-batches, "
             f"{len(s)} ops; {result.comm} communication, {len(result.transfers)} transfers",
             f"makespan {_n(result.makespan)}{unit}; " + (
                 f"bubble {result.bubble:.1%} of the step, {result.bubble_vs_ideal:.1%} of "
                 f"the ideal step; critical path {len(result.critical_path)} ops, "
                 f"{_n(result.critical_path_time)}{unit} of compute" if result.makespan > 0
                 else "every op costs nothing here, so there is no bubble to measure")]
    if result.makespan > 0:
        lines.append(steady_line(steady(result), unit))
    if result.has_reductions:
        lines.append(
            f"gradient all-reduce (dp = {result.costs.dp}): {_n(result.reduction_time)}{unit} on "
            f"the busiest rank, {_n(result.exposed_reduction)}{unit} exposed, "
            f"{result.hidden_reduction:.1%} hidden; step {_n(result.makespan)}{unit} with "
            f"reductions vs {_n(result.compute_makespan or 0.0)}{unit} if all were hidden")
    lines.append("")
    head = ["rank", "busy", "idle", "util", "peak act", "peak at"]
    if result.comm == "blocking":
        head.insert(3, "sending")
    if result.peak_bytes is not None:
        head.append("peak bytes")
    rows = [head]
    for r in range(c.ranks):
        row = [f"r{r}", _n(result.busy[r]), _n(result.idle[r]),
               f"{result.utilisation[r]:.1%}", f"{result.peak_activations[r]:g}",
               _n(result.peak_time[r])]
        if result.comm == "blocking":
            row.insert(3, _n(result.sending[r]))
        if result.peak_bytes is not None:
            row.append(_bytes(result.peak_bytes[r]))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines.extend("  ".join(cell.rjust(w) for cell, w in zip(row, widths)).rstrip()
                 for row in rows)
    return "\n".join(lines)


def steady_line(st: SteadyState, unit: str) -> str:
    """The steady state in one line (`pipeir.sim.steady` defines both figures)."""
    return (f"steps back to back: {_n(st.step)}{unit} per step, bubble {st.bubble:.1%}; "
            f"longest rank span {_n(st.longest_span)}{unit}, bubble {st.span_bubble:.1%} "
            "(the Zero Bubble paper's figure)")


def steady_json(st: SteadyState) -> dict[str, object]:
    """The steady state for --json."""
    return {"step": round(st.step, 9), "bubble": round(st.bubble, 9),
            "longest_span": round(st.longest_span, 9),
            "span_bubble": round(st.span_bubble, 9),
            "spans": [round(x, 9) for x in st.spans]}


def _n(x: float) -> str:
    return f"{x:.6g}"


def _bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"
