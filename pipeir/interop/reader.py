"""Read torch.distributed.pipelining schedules: its CSV files and its in-memory action lists.

A `compute_only` file has only F/B/I/W (and OVERLAP_F_B pairs); a `compute_comms` file also
places every send and receive, and REDUCE_GRAD. Reading infers ranks, stages, the placement
(which rank's row each stage appears in) and the micro-batch count, and builds the compute
ops into a `Schedule` whose spans point at the CSV cells; all actions are kept, with their
cells, for the communication proof (`pipeir.interop.check`).
"""

from __future__ import annotations

import csv
import os
import re
import reprlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipeir import limits
from pipeir.config import ConfigError, PipelineConfig
from pipeir.diagnostics import Diagnostic, Note, Source, Span, UsageError, VerifyError
from pipeir.interop.actions import COMMS, COMPUTE, FORMATS, OVERLAP, Action, Format, parse_action
from pipeir.ops import NO_MB, Op
from pipeir.schedule import Schedule


@dataclass(frozen=True)
class Imported:
    """A torch schedule read into pipeir.

    `schedule` holds the compute ops (spans point at the CSV cells); `actions` every rank's
    actions in order (idle cells dropped), communication included; `where[r][i]` is the span
    of `actions[r][i]`.
    """

    schedule: Schedule
    actions: tuple[tuple[Action, ...], ...]
    where: tuple[tuple[Span | None, ...], ...]
    format: Format

    @property
    def has_comms(self) -> bool:
        return self.format == "compute_comms"


# ---- reading -------------------------------------------------------------------------------

def load_csv(path: str | os.PathLike[str], microbatches: int | None = None,
             format: str = "auto") -> Imported:
    """Read a torch schedule CSV (`format`: auto, compute_only or compute_comms)."""
    text = limits.read_input(path, "torch schedule CSV").text
    return loads_csv(text, name=str(path), microbatches=microbatches, format=format)


def loads_csv(text: str, name: str = "<csv>", microbatches: int | None = None,
              format: str = "auto") -> Imported:
    """Read CSV text; see `load_csv`."""
    if not isinstance(text, str):
        raise TypeError(f"loads_csv reads a CSV's text; for a file, load_csv(path) (got "
                        f"{reprlib.repr(text)})")
    if text.endswith(".csv") and not any(c in text for c in ",\n"):  # (a path, not a row)
        raise UsageError(f"loads_csv reads a CSV's text, and {text!r} looks like a file's "
                         f"name: load_csv(path) reads a file")
    if not isinstance(name, str):
        raise TypeError(f"loads_csv(name=...): the name its errors give, a string, got {name!r}")
    source = Source(name, text)
    rows: list[list[tuple[Action, Span]]] = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        row: list[tuple[Action, Span]] = []
        for cell, col in _cells(line):
            span = Span(source, lineno, col, lineno, col + max(1, len(cell)))
            try:
                action = parse_action(cell)
            except ValueError as e:
                raise UsageError(f"row {lineno}, cell {len(row) + 1}: {e}", span) from None
            if action is not None:
                row.append((action, span))
        rows.append(row)
    while rows and not rows[-1] and not text.splitlines()[len(rows) - 1].strip():
        rows.pop()  # blank lines at the end are not ranks
    if not rows:
        raise UsageError(f"{name}: empty schedule (no rows)")
    return _build(rows, name, microbatches, format)


def from_torch_actions(actions_by_rank: Sequence[Iterable[object]] | dict[int, Iterable[object]],
                       microbatches: int | None = None, format: str = "auto") -> Imported:
    """Import torch's in-memory order: `schedule.pipeline_order` (a dict rank -> actions),
    `pipeline_order_with_comms`, or `get_schedule_ops(...)` (a list per rank). Items are
    torch `_Action`s (or their strings); None is an idle step."""
    if isinstance(actions_by_rank, str | bytes | os.PathLike) or \
            not isinstance(actions_by_rank, Iterable):
        raise TypeError(f"from_torch_actions takes each rank's actions (a dict rank -> "
                        f"actions, or a list per rank), got {type(actions_by_rank).__name__}; "
                        f"for a CSV's text, loads_csv(text); for a file, load_csv(path)")
    if isinstance(actions_by_rank, dict):
        ranks = sorted(actions_by_rank)
        if ranks != list(range(len(ranks))):
            raise UsageError(f"ranks must be 0 to {len(ranks) - 1}, got {ranks}")
        seq: list[Iterable[object]] = [actions_by_rank[r] for r in ranks]
    else:
        seq = list(actions_by_rank)
    for r, rank in enumerate(seq):
        if isinstance(rank, str | bytes) or not isinstance(rank, Iterable):
            raise TypeError(f"from_torch_actions: rank {r}'s actions must be a list of torch "
                            f"actions (or their strings), got {type(rank).__name__} "
                            f"{reprlib.repr(rank)}")
    lines = [",".join("" if a is None else _cell(a, r) for a in rank) for r, rank in enumerate(seq)]
    return loads_csv("\n".join(lines) + "\n", "<torch actions>", microbatches, format)


def _cell(action: object, rank: int) -> str:
    """One action as its CSV cell: a string holding a comma or a line break would be read as
    several cells or ranks."""
    text = str(action)
    if any(c in text for c in ",\n\r"):
        raise UsageError(f"rank {rank}'s action {text!r} holds a comma or a line break: give "
                         f"one action per item")
    return text


def _cells(line: str) -> list[tuple[str, int]]:
    """The cells of one CSV line with their 1-based start columns."""
    if '"' in line:  # quoted cells (torch never writes them, but a spreadsheet may)
        out, col = [], 1
        for cell in next(csv.reader([line])):
            out.append((cell, col))
            col += len(cell) + 1
        return out
    out, col = [], 1
    for cell in line.split(","):
        out.append((cell, col))
        col += len(cell) + 1
    return out


def _build(rows: list[list[tuple[Action, Span]]], name: str, microbatches: int | None,
           format: str) -> Imported:
    if format not in ("auto", *FORMATS):
        raise UsageError(f"unknown format '{format}' (expected auto, compute_only or "
                         f"compute_comms)")
    flat = [(r, a, sp) for r, row in enumerate(rows) for a, sp in row]
    comm = next(((a, sp) for _, a, sp in flat if a.kind in COMMS), None)
    if format == "auto":
        format = "compute_comms" if comm is not None else "compute_only"
    elif format == "compute_only" and comm is not None:
        raise UsageError(f"{comm[0]} is a communication action, but the format is "
                         f"compute_only (use --format compute_comms or auto)", comm[1])
    placement = _placement(rows, name)
    stages = len(placement)
    mbs = [x.mb for _, a, _ in flat for x in (a.sub or (a,)) if x.mb is not None]
    if microbatches is None:
        if not mbs:
            raise UsageError(f"{name}: no micro-batch appears; give --microbatches")
        microbatches = max(mbs) + 1
    try:
        config = PipelineConfig(len(rows), microbatches, stages, tuple(placement))
    except ConfigError as e:
        raise UsageError(f"{name}: {e}") from None
    programs: list[list[Op | tuple[Op, Op]]] = []
    spans: dict[Op, Span | None] = {}
    for row in rows:
        prog: list[Op | tuple[Op, Op]] = []
        for a, sp in row:
            if a.kind == OVERLAP:
                x, y = a.sub[0].op, a.sub[1].op
                prog.append((x, y))
                spans[x] = spans[y] = sp
            elif a.kind in COMPUTE:
                prog.append(a.op)
                spans[a.op] = sp
            elif a.kind == "REDUCE_GRAD" and Op("R", a.stage, NO_MB) not in spans:
                # the gradient all-reduce of data parallelism (a second one of a stage is
                # left to `pipeirc check`, which names the cell)
                red = Op("R", a.stage, NO_MB)
                prog.append(red)
                spans[red] = sp
        programs.append(prog)
    schedule = Schedule.from_programs(config, programs, name=_identifier(Path(name).stem),
                                      spans=spans)
    return Imported(schedule, tuple(tuple(a for a, _ in row) for row in rows),
                    tuple(tuple(sp for _, sp in row) for row in rows),
                    format)  # type: ignore[arg-type]


def _identifier(stem: str) -> str:
    """A schedule name the printer can write: the file's stem with non-word characters as _."""
    name = re.sub(r"\W", "_", stem)
    return name if name and not name[0].isdigit() else f"torch_{name}"


def _placement_error(message: str, span: Span | None = None, notes: tuple[Note, ...] = ()
                     ) -> VerifyError:
    """A file whose cells read but whose stages cannot be placed is an invalid schedule (exit
    1, like torch's own `_validate_schedule`), not a syntax error."""
    return VerifyError(Diagnostic(message, span, notes), check="placement")


def _placement(rows: list[list[tuple[Action, Span]]], name: str) -> list[int]:
    """Which rank runs each stage: every action names a stage of the rank whose row it is in
    (a RECV_F of stage s is posted by the rank that runs s)."""
    owner: dict[int, tuple[int, Span]] = {}
    for r, row in enumerate(rows):
        for a, sp in row:
            for x in a.sub or (a,):
                first = owner.setdefault(x.stage, (r, sp))
                if first[0] != r:
                    fs = first[1]
                    raise _placement_error(
                        f"stage {x.stage} appears on two ranks: rank {first[0]} (row {fs.line}, "
                        f"column {fs.col}) and rank {r} (row {sp.line}, column {sp.col}); a "
                        f"stage lives on one rank", sp,
                        (Note(f"stage {x.stage} is first on rank {first[0]} here", fs),))
    if not owner:
        raise UsageError(f"{name}: no actions in any row")
    stages = max(owner) + 1
    if len(owner) < stages:  # the first gap, found without a list as long as the stage number
        missing = next(s for s, t in enumerate(sorted(owner)) if s != t)
        raise _placement_error(f"{name}: stage {missing} appears in no cell, but stage "
                         f"{stages - 1} does; stages must be 0 to {stages - 1}")
    return [owner[s][0] for s in range(stages)]


