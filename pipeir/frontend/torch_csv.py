"""Import torch.distributed.pipelining schedules: its CSV files and its action lists.

torch writes a schedule as one CSV row per rank and one action per cell (`_dump_csv`):
`{stage}{type}{mb}` such as `2F0`, `0I3`, `1W3`, `0SEND_F1`, `1RECV_B0`; `{stage}{type}`
for `UNSHARD`, `RESHARD` and `REDUCE_GRAD`; `(0F7;7B3)OVERLAP_F_B` for ops a rank runs
together; an empty cell is an idle step. A `compute_only` file has only F/B/I/W (and
REDUCE_GRAD); a `compute_comms` file also places every send and receive.

The grammar is re-implemented here (from `_Action.from_str`) so that importing stays free of
torch. It is stricter than torch's, which uses `re.match` and so reads `2F0xyz` as `2F0`:
anything but a whole action is a diagnostic naming the row and column.

NOTE (torch's communication semantics, as `_PipelineScheduleRuntime` executes them): SEND_x
and RECV_x *post* an isend / irecv and never block; a forward waits for its stage's posted
RECV_F, a backward (B or I) for its RECV_B, and all sends are waited for at the end of the
step. `SEND_F` of stage s goes to the rank of stage s+1 and `RECV_F` of stage s comes from
stage s-1; `SEND_B` / `RECV_B` go the other way. `lowered()` writes exactly that as pipeir's
lowered instructions (isend, irecv, wait-recv before the compute, wait-send at the end), so
`pipeir.backend.commcheck` proves the file deadlock-free or names the waiting chain, where
torch would hang until the process-group timeout.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, Literal

from pipeir.config import ConfigError, PipelineConfig
from pipeir.diagnostics import Diagnostic, Note, Source, Span, UsageError, VerifyError
from pipeir.ops import Op
from pipeir.schedule import Schedule

if TYPE_CHECKING:
    from pipeir.backend.commcheck import CommReport
    from pipeir.backend.lower import Instr, Lowered

Format = Literal["compute_only", "compute_comms"]
FORMATS: Final = ("compute_only", "compute_comms")

COMPUTE: Final = ("F", "B", "I", "W")
COMMS: Final = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
#: Actions that only matter to FSDP and data parallelism; imported and ignored.
BOOKKEEPING: Final = ("UNSHARD", "RESHARD", "REDUCE_GRAD")
OVERLAP: Final = "OVERLAP_F_B"

_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)"
                     r"(\d*)")


@dataclass(frozen=True)
class Action:
    """One torch action. `sub` holds the ops of an OVERLAP_F_B (whose stage is -1)."""

    stage: int
    kind: str
    mb: int | None = None
    sub: tuple[Action, ...] = ()

    def __str__(self) -> str:
        """torch's spelling (`_Action.__repr__`), which `parse_action` reads back."""
        if self.kind == OVERLAP:
            return f"({';'.join(map(str, self.sub))}){OVERLAP}"
        return f"{self.stage}{self.kind}{'' if self.mb is None else self.mb}"

    @property
    def op(self) -> Op:
        """The compute op of an F/B/I/W action."""
        assert self.kind in COMPUTE and self.mb is not None
        return Op(self.kind, self.stage, self.mb)  # type: ignore[arg-type]


def parse_action(text: str) -> Action | None:
    """Read one cell: None for an empty (idle) cell; ValueError saying what is wrong."""
    text = text.strip()
    if not text:
        return None
    if text.startswith("("):
        close = text.find(")")
        if close < 0:
            raise ValueError(f"'{text}': '(' without ')'")
        kind = text[close + 1:]
        if kind != OVERLAP:
            raise ValueError(f"'{text}': a group of actions must end in ){OVERLAP}, "
                             f"got ')'{kind!r}")
        subs = [parse_action(part) for part in text[1:close].split(";")]
        parts = tuple(a for a in subs if a is not None)
        if len(parts) != 2 or any(a.kind not in COMPUTE for a in parts):
            raise ValueError(f"'{text}': {OVERLAP} must group exactly two compute actions "
                             f"(F, B, I or W)")
        return Action(-1, OVERLAP, None, parts)
    m = _ACTION.fullmatch(text)
    if m is None:
        raise ValueError(f"'{text}' is not a torch action; expected {{stage}}{{type}}{{mb}} "
                         f"such as 2F0, 0I3, 1SEND_F1, 0REDUCE_GRAD or (0F7;7B3){OVERLAP}")
    stage, kind, mb = int(m[1]), m[2], m[3]
    if kind in BOOKKEEPING:
        return Action(stage, kind, int(mb) if mb else None)
    if not mb:
        raise ValueError(f"'{text}': {kind} needs a micro-batch number, e.g. {stage}{kind}0")
    return Action(stage, kind, int(mb))


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

    def lowered(self) -> Lowered:
        """The communication as torch's runtime runs it, as pipeir lowered programs (for
        `pipeir.backend.commcheck.check_comm`); only for `compute_comms` schedules."""
        if not self.has_comms:
            raise UsageError("only a compute_comms schedule places its communication; a "
                             "compute_only one is lowered by pipeir (`pipeirc check --lowered`)")
        return _lower(self)


# ---- reading -------------------------------------------------------------------------------

def load_csv(path: str | os.PathLike[str], microbatches: int | None = None,
             format: str = "auto") -> Imported:
    """Read a torch schedule CSV (`format`: auto, compute_only or compute_comms)."""
    text = Source.read(path, "torch schedule CSV").text
    return loads_csv(text, name=str(path), microbatches=microbatches, format=format)


def loads_csv(text: str, name: str = "<csv>", microbatches: int | None = None,
              format: str = "auto") -> Imported:
    """Read CSV text; see `load_csv`."""
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
    if isinstance(actions_by_rank, dict):
        ranks = sorted(actions_by_rank)
        if ranks != list(range(len(ranks))):
            raise UsageError(f"ranks must be 0..{len(ranks) - 1}, got {ranks}")
        seq: list[Iterable[object]] = [actions_by_rank[r] for r in ranks]
    else:
        seq = list(actions_by_rank)
    lines = [",".join("" if a is None else str(a) for a in rank) for rank in seq]
    return loads_csv("\n".join(lines) + "\n", "<torch actions>", microbatches, format)


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
                    raise UsageError(
                        f"stage {x.stage} appears on two ranks: rank {first[0]} (row {fs.line}, "
                        f"column {fs.col}) and rank {r} (row {sp.line}, column {sp.col}); a "
                        f"stage lives on one rank", sp,
                        (Note(f"stage {x.stage} is first on rank {first[0]} here", fs),))
    if not owner:
        raise UsageError(f"{name}: no actions in any row")
    stages = max(owner) + 1
    missing = [s for s in range(stages) if s not in owner]
    if missing:
        raise UsageError(f"{name}: stage {missing[0]} appears in no cell, but stage "
                         f"{stages - 1} does; stages must be 0..{stages - 1}")
    return [owner[s][0] for s in range(stages)]


# ---- torch's communication as lowered programs ---------------------------------------------

def _lower(imp: Imported) -> Lowered:
    from pipeir.backend import lower as L

    cfg = imp.schedule.config
    programs: list[tuple[Instr, ...]] = []
    for rank, (row, where) in enumerate(zip(imp.actions, imp.where)):
        prog: list[Instr] = [L.ZeroGrad()]
        for action, span in zip(row, where):
            for a in action.sub or (action,):
                if a.kind not in BOOKKEEPING:
                    prog += _instructions(a, rank, cfg, span)
        # torch waits for its sends at the end of the step, last posted first
        sends = [c for c in prog if isinstance(c, L.ISend)]
        prog += [L.WaitSend(c.tensor, c.stage, c.mb, c.peer, c.tag, op=c.op, at=c.at)
                 for c in reversed(sends)]
        prog.append(L.OptimizerStep())
        programs.append(tuple(prog))
    return L.Lowered(imp.schedule.name, cfg.ranks, cfg.stages, cfg.microbatches, 1,
                     cfg.placement, tuple(programs), overlap=True)


def _instructions(a: Action, rank: int, cfg: PipelineConfig, span: Span | None
                  ) -> list[Instr]:
    """What torch's runtime does for action `a` on `rank`, as lowered instructions."""
    from pipeir.backend import lower as L

    assert a.mb is not None
    s, mb, last, place = a.stage, a.mb, cfg.stages - 1, cfg.placement
    where = {"op": str(a), "at": f"{span.file}:{span.line}:{span.col}" if span else ""}

    def comm(cls: type[L.Comm], tensor: L.Tensor, producer: int, peer: int) -> L.Comm:
        return cls(tensor, producer, mb, peer, L.tag_of(tensor, producer, mb, cfg.stages),
                   op=where["op"], at=where["at"])

    def origin(ins: L.Instr) -> L.Instr:
        return dataclasses.replace(ins, op=where["op"], at=where["at"])

    if a.kind in COMMS:
        tensor: L.Tensor = "act" if a.kind.endswith("_F") else "grad"
        send = a.kind.startswith("SEND")
        src = s if send else (s - 1 if tensor == "act" else s + 1)
        dst = (s + 1 if tensor == "act" else s - 1) if send else s
        if not (0 <= src <= last and 0 <= dst <= last):
            raise UsageError(f"{a}: there is no stage {dst if send else src} to "
                             f"{'send to' if send else 'receive from'} (stages are "
                             f"0..{last})", span)
        peer = place[dst] if send else place[src]
        if peer == rank:
            raise UsageError(f"{a}: stages {min(src, dst)} and {max(src, dst)} both run on "
                             f"rank {rank}; torch hands the tensor over locally, so there is "
                             f"nothing to {'send' if send else 'receive'}", span)
        return [comm(L.ISend if send else L.IRecv, tensor, src, peer)]
    out: list[Instr] = []
    if a.kind == "F":
        if s > 0 and place[s - 1] != rank:
            out.append(comm(L.WaitRecv, "act", s - 1, place[s - 1]))
        if s == 0:
            out.append(L.Load(mb, "input"))
        out.append(L.Forward(s, mb))
        if s == last:
            out += [L.Load(mb, "target"), L.Loss(s, mb, 1.0 / cfg.microbatches)]
        elif place[s + 1] == rank:
            out.append(L.Handoff("act", s, mb))
    elif a.kind in ("B", "I"):
        if s < last and place[s + 1] != rank:
            out.append(comm(L.WaitRecv, "grad", s + 1, place[s + 1]))
        out.append(L.Backward(s, mb) if a.kind == "B" else L.BackwardInput(s, mb))
        if s > 0 and place[s - 1] == rank:
            out.append(L.Handoff("grad", s, mb))
    else:
        out.append(L.BackwardWeight(s, mb))
    return [origin(i) for i in out]


def check_csv(path: str, memory_limit: int | None = None) -> list[str]:
    """`pipeirc check FILE.csv`: verify the compute order and, for a compute_comms file, prove
    torch's placement of sends and receives deadlock-free. Lines to print; VerifyError if not."""
    from pipeir.verify import verify

    imported = load_csv(path)
    s = imported.schedule
    report = verify(s, memory_limit=memory_limit)
    c = s.config
    lines = [f"{path}: ok: {c.ranks} ranks, {c.stages} stages, {c.microbatches} micro-batches, "
             f"{len(s)} ops ({imported.format}); peak in-flight activations per rank: "
             f"{' '.join(map(str, report.peak_activations))}"]
    if imported.has_comms:
        comm = prove_comms(imported)
        lines.append(f"{path}: comms ok: {comm.total} transfers over {len(comm.transfers)} rank "
                     f"pairs; deadlock-free as torch runs them (isend/irecv posted in file order, "
                     f"each compute waits for its receive)")
    return lines


def prove_comms(imported: Imported) -> CommReport:
    """Prove that torch's runtime cannot hang on the file's sends and receives; otherwise a
    VerifyError(check="comm") naming the chain of ranks waiting on each other."""
    from pipeir.backend.commcheck import check_comm

    try:
        return check_comm(imported.lowered())
    except VerifyError as e:
        d = e.diagnostics[0]
        first = next((sp for row in imported.where for sp in row if sp is not None), None)
        name = first.file if first is not None else "<csv>"
        raise VerifyError(Diagnostic(
            f"{name}: torch's runtime would hang on this schedule: {d.message}", d.span,
            (*d.notes, Note("torch accepts such a compute_comms file and then waits until the "
                            "process-group timeout"))), check=e.check) from None
