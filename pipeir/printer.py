"""The canonical text form of a schedule: explicit, loop-free `.sched` that re-parses to an
equal schedule. Deterministic, so it can be diffed and golden-tested."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pipeir.schedule import Schedule, expect_schedule
from pipeir.sim.costs import CostModel

WIDTH = 96  # wrap op lists at this many columns


def print_schedule(schedule: Schedule, costs: Mapping[str, Any] | None = None) -> str:
    """`schedule` as canonical `.sched` text (with a `costs` block when costs are given:
    the block's settings, e.g. {"F": 1, "B": 2}, checked as a costs block is read, so the
    text parses again)."""
    c = expect_schedule(schedule, "print_schedule").config
    if costs is not None:
        if not isinstance(costs, Mapping):
            raise TypeError(f"print_schedule(costs=...): expected a costs block's settings, "
                            f"e.g. {{'F': 1, 'B': 2}}, got {type(costs).__name__}")
        CostModel.from_settings(costs, where="print_schedule(costs=...)")
    out = ["# canonical form (pipeirc print)",
           "pipeline {",
           f"    ranks = {c.ranks}",
           f"    microbatches = {c.microbatches}",
           f"    stages = {c.stages}",
           f"    placement = {c.placement_name or _list(c.placement)}"]
    if c.memory_limit is not None:
        out.append(f"    memory_limit = {c.memory_limit}")
    if c.accumulate != 1:
        out.append(f"    accumulate = {c.accumulate}")
    out.append("}")
    if costs:
        out.append("")
        out.append("costs {")
        out.extend(f"    {k} = {_value(v)}" for k, v in sorted(costs.items()))
        out.append("}")
    out.append("")
    out.append(f"schedule {_identifier(schedule.name)} {{")
    for r, prog in enumerate(schedule.programs):
        out.append(f"    rank {r} {{")
        line = "       "
        for op in prog:
            if schedule.pair_prev(op) is not None:
                continue  # printed with its partner
            partner = schedule.pair_next(op)
            text = f" overlap {{ {op} {partner} }}" if partner is not None else f" {op}"
            if len(line) + len(text) > WIDTH:
                out.append(line)
                line = "       "
            line += text
        if line.strip():
            out.append(line)
        out.append("    }")
    out.append("}")
    return "\n".join(out) + "\n"


def _list(items: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, items)) + "]"


def _value(v: Any) -> str:
    if isinstance(v, tuple | list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):  # e.g. unit = "ms": a bare name would not re-parse
        return f'"{v}"'
    return str(v)


def _identifier(name: str) -> str:
    """A schedule name the grammar accepts (Python-built schedules may be named anything)."""
    ident = re.sub(r"\W", "_", name, flags=re.ASCII) or "schedule"
    return f"s_{ident}" if ident[0].isdigit() else ident
