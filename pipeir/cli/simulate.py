"""pipeirc simulate: what a schedule costs (makespan, bubble, memory) and when each op runs."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import replace
from typing import Any

from pipeir.cli.common import (
    add_schedule_args,
    columns,
    is_cost_setting,
    load_one,
    parse_override,
)
from pipeir.config import PipelineConfig
from pipeir.diagnostics import Diagnostic, Span, UsageError, did_you_mean
from pipeir.files import resolve_output, write_atomic
from pipeir.frontend.elaborate import Elaborated
from pipeir.sim import COMM_MODELS, CostModel, SimResult, simulate
from pipeir.sim.cost_files import read_cost_file
from pipeir.sim.cost_settings import TOP_KEYS
from pipeir.sim.lengths import check_count, split_length_settings
from pipeir.verify import verify

COST_NAMES = ", ".join((*TOP_KEYS, "stage.S.K", "mb.M.K", "stage.S.mb.M.K"))

ORDER = 40
NAME = "simulate"
HELP = "simulate a schedule: makespan, bubble, peak memory and an ASCII timeline"


def add_costs_arg(p: argparse.ArgumentParser) -> None:
    """--costs (cost settings in --set are handled by `load_with_costs`)."""
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
    elab, costs = load_with_costs(args)
    verify(elab.schedule)
    return simulate(elab.schedule, costs, comm=args.comm)


def load_with_costs(args: argparse.Namespace) -> tuple[Elaborated, CostModel]:
    """The schedule the command line names and its cost model: the `.sched` file's
    costs block, or `--costs FILE` instead, with cost names in `--set` on top. The schedule's
    `costs` become those settings (less the cost file's free-form `meta` table, which a
    costs block cannot hold), so a command that prints it writes the costs it used."""
    cost_sets: dict[str, tuple[Any, Span | None]] = {}
    rest = []
    for text in args.overrides:
        name, value = parse_override(text)
        if is_cost_setting(name):
            cost_sets[name] = (value, None)
        else:
            rest.append(text)
    args.overrides = rest
    try:
        elab = load_one(args)
    except UsageError as e:
        raise with_cost_names(e, rest) from None
    settings: dict[str, tuple[Any, Span | None]] = \
        read_cost_file(args.costs) if args.costs else dict(elab.costs)
    CostModel.from_settings(cost_sets, where="--set")  # so --set errors name --set
    merged = {**settings, **cost_sets}
    costs = CostModel.from_settings(merged)
    if args.costs and elab.costs:
        _warn_replaced(args.costs, elab, costs)
    _, spec = split_length_settings(merged)
    if spec is not None:
        check_count(spec, elab.schedule.config.microbatches, merged["lengths"][1],
                    "--set" if "lengths" in cost_sets else args.costs)
    _warn_unused(elab.schedule.config, merged)
    written = {k: v for k, v in merged.items() if k != "meta" and not k.startswith("meta.")}
    return replace(elab, costs=written), costs


def _warn_replaced(path: str, elab: Elaborated, costs: CostModel) -> None:
    """--costs replaces a file's own costs block: say so, and say why it is likely wrong when
    the cost file describes fewer stages than the schedule has (what `pipeirc tune -o` writes
    is costs per chunk, rescaled from the cost file, for that schedule alone)."""
    from pipeir.search.tune import infer_ranks

    stages = elab.schedule.config.stages
    described = infer_ranks(costs)
    why = ""
    if described is not None and described < stages:
        why = (f"; {path} describes {described} stages but the schedule has {stages}: if "
               "`pipeirc tune` wrote this file, its costs block holds the per-chunk costs it "
               "ranked by, so simulate it without --costs")
    n = len(elab.costs)
    d = Diagnostic(f"--costs {path} replaces the schedule file's own costs block "
                   f"({n} setting{'s' if n != 1 else ''}){why}", severity="warning")
    print(d.render(), file=sys.stderr)


def _warn_unused(config: PipelineConfig, settings: dict[str, tuple[Any, Span | None]]) -> None:
    """A cost for a stage or micro-batch the pipeline does not have changes nothing: usually a
    typo, sometimes a sweep (`--set microbatches=4` on a file with per-micro-batch costs)."""
    for name, (_, span) in settings.items():
        parts = name.split(".")
        for key, count in (("stage", config.stages), ("mb", config.microbatches)):
            if key in parts[:-1]:
                i = parts.index(key)
                idx = parts[i + 1] if i + 1 < len(parts) else ""
                if idx.isdigit() and (len(idx) > 18 or int(idx) >= count):
                    d = Diagnostic(f"cost '{name}' names {key} {idx}, but the pipeline has "
                                   f"{count} ({key} 0 to {count - 1}); it is ignored", span,
                                   severity="warning")
                    print(d.render(), file=sys.stderr)


def with_cost_names(e: UsageError, sets: list[str]) -> UsageError:
    """An unknown --set name may be a misspelt cost: say that costs are settable too."""
    d = e.diagnostics[0]
    for text in sets:
        name = text.split("=", 1)[0].strip()
        if d.message.startswith(f"--set {name}: unknown setting"):
            candidates = [*TOP_KEYS, *(f"stage.0.{k}" for k in "FBIW")]
            notes = d.notes or did_you_mean(name, candidates)
            return UsageError(f"{d.message}; or a cost: {COST_NAMES}", d.span, notes)
    return e


def run(args: argparse.Namespace) -> int:
    if args.trace is not None:
        resolve_output(args.trace, "--trace")
    result = simulate_args(args)
    if args.trace is not None:
        from pipeir.views.trace import chrome_trace

        write_atomic(args.trace, json.dumps(chrome_trace(result)), "--trace")
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
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
               f"{result.utilisation[r]:.1%}", str(result.peak_activations[r]),
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


def _n(x: float) -> str:
    return f"{x:.6g}"


def _bytes(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"
