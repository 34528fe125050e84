"""`pipeirc show`: the per-rank op grid, one column per time step (every op takes one step,
as in torch.distributed.pipelining's pipeline_order), wrapped to the terminal's width."""

from __future__ import annotations

from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.sim import CostModel, simulate

IDLE = "."


def unit_steps(schedule: Schedule) -> dict[Op, int]:
    """The step at which each op runs if every op takes one step and starts as early as its
    rank's program order and its data dependencies allow: the simulator with unit costs and
    free communication. A deadlocking schedule raises VerifyError (check "deadlock")."""
    result = simulate(schedule, CostModel(F=1.0, B=1.0, I=1.0, W=1.0))
    return {op: round(t) for op, t in result.start.items()}


def label(op: Op, schedule: Schedule) -> str:
    """`F12`, or `F12b` when a rank owns several stages (b = its second chunk)."""
    c = schedule.config
    owned = c.stages_of(c.placement[op.stage]) if 0 <= op.stage < c.stages else ()
    if len(owned) <= 1:
        return f"{op.kind}{op.mb}"
    return f"{op.kind}{op.mb}{chr(ord('a') + owned.index(op.stage))}"


def render_grid(schedule: Schedule, width: int = 100) -> str:
    """The grid as text: a legend, then blocks of time steps that fit in `width` columns."""
    steps = unit_steps(schedule)
    n_steps = max((t for op, t in steps.items() if op.kind != "R"), default=-1) + 1
    ranks = schedule.config.ranks
    cells = [[IDLE] * n_steps for _ in range(ranks)]
    for op, t in steps.items():
        if op.kind != "R":  # reductions run beside compute, on their own channel
            cells[schedule.rank_of(op)][t] = label(op, schedule)
    cw = max([len(IDLE), *(len(label(op, schedule)) for op in steps if op.kind != "R")])
    head = f"r{ranks - 1}"
    prefix = len(head) + 3
    per_block = max(1, (width - prefix) // (cw + 1))
    multi = any(len(schedule.config.stages_of(r)) > 1 for r in range(ranks))
    out = [f"{schedule.name}: {ranks} ranks, {schedule.config.stages} stages, "
           f"{schedule.config.microbatches} micro-batches, {n_steps} steps "
           f"(one step per op; '{IDLE}' = idle"
           + ("; a, b, ... = the rank's 1st, 2nd, ... stage" if multi else "") + ")"]
    for lo in range(0, n_steps, per_block):
        hi = min(n_steps, lo + per_block)
        ruler = "".join(f"{t:<{cw + 1}}" if t % 5 == 0 else " " * (cw + 1)
                        for t in range(lo, hi))
        out.append("")
        out.append(" " * prefix + ruler.rstrip())
        for r in range(ranks):
            row = " ".join(f"{c:<{cw}}" for c in cells[r][lo:hi])
            out.append(f"{'r' + str(r):>{len(head)}} | {row}".rstrip())
    return "\n".join(out) + "\n"
