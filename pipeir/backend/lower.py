"""Lowering: a verified `Schedule` becomes one straight-line instruction program per rank.

A lowered program is one optimizer step: `zero-grad`, `accumulate` rounds of the schedule
(round r works on micro-batches r*m .. r*m+m-1 of the step's batch), then `step`.

NOTE (why blocking send/recv cannot deadlock here): communication is placed by a list-scheduling
simulation of the schedule (unit costs F=1, B=2, I=W=1 unless given). Every cross-rank tensor is
one *transfer event* at the time its producer ends; compute events sit at their start times.
Sorting all events by time (a transfer before a compute at the same time) gives one global
order in which each rank's projection is its program and every send meets its receive at the
same point. Executing that global order is a valid run under rendezvous semantics, so no rank
can wait forever; `pipeir.backend.commcheck` proves it again on the emitted programs. Transfers
between a pair of ranks appear in the same order on both sides (per-peer FIFO, as NCCL needs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from pipeir.diagnostics import UsageError
from pipeir.ops import Op
from pipeir.schedule import Schedule, data_predecessors
from pipeir.verify import verify

Tensor = Literal["act", "grad"]
Part = Literal["input", "target"]

#: Default relative op costs used only to place communication (not for correctness).
DEFAULT_COSTS: Mapping[str, float] = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


@dataclass(frozen=True)
class Instr:
    """Base of every instruction. `op` and `at` name the schedule op and `.sched` line
    (`file:line`) it came from, so errors at run time can point back into the source."""

    op: str = field(default="", kw_only=True)
    at: str = field(default="", kw_only=True)

    @property
    def mnemonic(self) -> str:
        return _MNEMONICS[type(self)]

    def operands(self) -> str:
        """The instruction's own fields, as the text form prints them."""
        parts = []
        for f in fields(self):
            if f.name in ("op", "at"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = "[" + "; ".join(f"{v.mnemonic} {v.operands()}" for v in value) + "]"
            parts.append(f"{f.name}={value}")
        return " ".join(parts)

    def __str__(self) -> str:
        text = f"{self.mnemonic} {self.operands()}".rstrip()
        origin = " ".join(x for x in (self.op, self.at) if x)
        return f"{text:<44} # {origin}" if origin else text


@dataclass(frozen=True)
class ZeroGrad(Instr):
    """Clear the gradients of this rank's stages (start of an optimizer step)."""


@dataclass(frozen=True)
class OptimizerStep(Instr):
    """Apply the optimizer to this rank's stages (end of an optimizer step)."""


@dataclass(frozen=True)
class Load(Instr):
    """Take micro-batch `mb`'s inputs (first stage) or targets (last stage) from the batch."""

    mb: int
    part: Part


@dataclass(frozen=True)
class Forward(Instr):
    stage: int
    mb: int


@dataclass(frozen=True)
class Loss(Instr):
    """Loss of the last stage's output, times `scale` = 1/(m*accumulate) so the accumulated
    gradients equal those of one big batch."""

    stage: int
    mb: int
    scale: float


@dataclass(frozen=True)
class Backward(Instr):
    """Full backward: input and weight gradients together; frees the activations."""

    stage: int
    mb: int


@dataclass(frozen=True)
class BackwardInput(Instr):
    """Input-gradient half (I): only what the previous stage waits for."""

    stage: int
    mb: int


@dataclass(frozen=True)
class BackwardWeight(Instr):
    """Weight-gradient half (W), after its I; frees the activations."""

    stage: int
    mb: int


@dataclass(frozen=True)
class Handoff(Instr):
    """Local hand-off between consecutive stages on the same rank (V placement): the `act`
    of `stage` becomes the input of stage+1, or the `grad` of `stage`'s input becomes the
    output gradient of stage-1."""

    tensor: Tensor
    stage: int
    mb: int


@dataclass(frozen=True)
class Comm(Instr):
    """A point-to-point transfer of `tensor` produced by `stage` for micro-batch `mb`.

    `act` flows from stage to stage+1, `grad` (the input gradient) from stage to stage-1."""

    tensor: Tensor
    stage: int
    mb: int
    peer: int
    tag: int

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.tensor, self.stage, self.mb)


@dataclass(frozen=True)
class Send(Comm):
    """Blocking send."""


@dataclass(frozen=True)
class Recv(Comm):
    """Blocking receive."""


@dataclass(frozen=True)
class ISend(Comm):
    """Post a send (isend); a later `WaitSend` completes it."""


@dataclass(frozen=True)
class IRecv(Comm):
    """Post a receive (irecv); a later `WaitRecv` completes it."""


@dataclass(frozen=True)
class WaitSend(Comm):
    pass


@dataclass(frozen=True)
class WaitRecv(Comm):
    pass


@dataclass(frozen=True)
class Batch(Instr):
    """Posts issued at the same point, as one `batch_isend_irecv`."""

    posts: tuple[Comm, ...]


_MNEMONICS: dict[type, str] = {
    ZeroGrad: "zero-grad", OptimizerStep: "step", Load: "load", Forward: "forward",
    Loss: "loss", Backward: "backward", BackwardInput: "backward-input",
    BackwardWeight: "backward-weight", Handoff: "handoff", Send: "send", Recv: "recv",
    ISend: "isend", IRecv: "irecv", WaitSend: "wait-send", WaitRecv: "wait-recv",
    Batch: "batch",
}
_BY_MNEMONIC: dict[str, type] = {v: k for k, v in _MNEMONICS.items()}

#: Instructions that do model compute (their time is "busy" in the measured bubble).
COMPUTE: tuple[type, ...] = (Forward, Loss, Backward, BackwardInput, BackwardWeight)


@dataclass(frozen=True)
class Lowered:
    """The lowered form of a schedule: per-rank programs for one optimizer step."""

    name: str
    ranks: int
    stages: int
    microbatches: int
    accumulate: int
    placement: tuple[int, ...]
    programs: tuple[tuple[Instr, ...], ...]
    overlap: bool = False

    def program(self, rank: int) -> tuple[Instr, ...]:
        return self.programs[rank]

    def with_programs(self, programs: Sequence[Sequence[Instr]], overlap: bool) -> Lowered:
        return Lowered(self.name, self.ranks, self.stages, self.microbatches, self.accumulate,
                       self.placement, tuple(tuple(p) for p in programs), overlap)


def tag_of(tensor: Tensor, stage: int, mb: int, stages: int) -> int:
    """A tag unique per tensor within a step (gloo matches on it; NCCL ignores it)."""
    return (mb * stages + stage) * 2 + (1 if tensor == "grad" else 0)


# ---- lowering ----------------------------------------------------------------------------------

def lower(schedule: Schedule, costs: Mapping[str, float] | None = None) -> Lowered:
    """Lower a schedule (verified here first) to per-rank instruction programs."""
    verify(schedule)
    cfg = schedule.config
    rounds = [_lower_round(schedule, costs or DEFAULT_COSTS, r) for r in range(cfg.accumulate)]
    programs = []
    for rank in range(cfg.ranks):
        prog: list[Instr] = [ZeroGrad()]
        for rnd in rounds:
            prog.extend(rnd[rank])
        prog.append(OptimizerStep())
        programs.append(tuple(prog))
    return Lowered(schedule.name, cfg.ranks, cfg.stages, cfg.microbatches, cfg.accumulate,
                   cfg.placement, tuple(programs))


def _times(schedule: Schedule, costs: Mapping[str, float]) -> dict[Op, tuple[float, float]]:
    """Start and end of every op under list scheduling (program order, data dependencies)."""
    cfg = schedule.config
    progs = schedule.programs
    pos = [0] * cfg.ranks
    free = [0.0] * cfg.ranks
    times: dict[Op, tuple[float, float]] = {}
    remaining = sum(len(p) for p in progs)
    while remaining:
        moved = False
        for r, prog in enumerate(progs):
            while pos[r] < len(prog):
                op = prog[pos[r]]
                preds = data_predecessors(op, schedule.graph, cfg.stages)
                if any(p not in times for p in preds):
                    break
                start = max([free[r], *(times[p][1] for p in preds)])
                end = start + float(costs.get(op.kind, DEFAULT_COSTS[op.kind]))
                times[op] = (start, end)
                free[r] = end
                pos[r] += 1
                remaining -= 1
                moved = True
        if not moved:  # pragma: no cover - verify() rejected deadlocks already
            raise AssertionError("schedule deadlocks after verification")
    return times


def _lower_round(schedule: Schedule, costs: Mapping[str, float], rnd: int
                 ) -> list[list[Instr]]:
    cfg = schedule.config
    last = cfg.stages - 1
    offset = rnd * cfg.microbatches
    scale = 1.0 / (cfg.microbatches * cfg.accumulate)
    times = _times(schedule, costs)
    events: list[tuple[tuple[Any, ...], int, list[tuple[int, Instr]]]] = []

    def origin(op: Op) -> dict[str, str]:
        span = schedule.span_of(op)
        return {"op": str(op), "at": f"{span.file}:{span.line}" if span is not None else ""}

    for rank, prog in enumerate(schedule.programs):
        for pos, op in enumerate(prog):
            start, end = times[op]
            s, mb, o = op.stage, op.mb + offset, origin(op)
            body: list[Instr] = []
            if op.kind == "F":
                if s == 0:
                    body.append(Load(mb, "input", **o))
                body.append(Forward(s, mb, **o))
                if s == last:
                    body += [Load(mb, "target", **o), Loss(s, mb, scale, **o)]
            elif op.kind == "B":
                body.append(Backward(s, mb, **o))
            elif op.kind == "I":
                body.append(BackwardInput(s, mb, **o))
            else:
                body.append(BackwardWeight(s, mb, **o))
            for tensor, dst in _outputs(op, cfg.stages):
                peer = cfg.placement[dst]
                consumer = _consumer(schedule, tensor, dst, op.mb)
                tag = tag_of(tensor, s, mb, cfg.stages)
                if peer == rank:
                    body.append(Handoff(tensor, s, mb, **o))
                    continue
                events.append(((end, 0, rank, pos, dst), peer, [
                    (rank, Send(tensor, s, mb, peer, tag, **o)),
                    (peer, Recv(tensor, s, mb, rank, tag, **origin(consumer)))]))
            events.append(((start, 1, rank, pos, 0), rank, [(rank, b) for b in body]))
    out: list[list[Instr]] = [[] for _ in range(cfg.ranks)]
    for _, _, items in sorted(events, key=lambda e: e[0]):
        for r, ins in items:
            out[r].append(ins)
    return out


def _outputs(op: Op, stages: int) -> list[tuple[Tensor, int]]:
    """The tensors `op` produces for another stage: (kind, consuming stage)."""
    if op.kind == "F" and op.stage + 1 < stages:
        return [("act", op.stage + 1)]
    if op.kind in ("B", "I") and op.stage > 0:
        return [("grad", op.stage - 1)]
    return []


def _consumer(schedule: Schedule, tensor: Tensor, stage: int, mb: int) -> Op:
    if tensor == "act":
        return Op("F", stage, mb)
    b = Op("B", stage, mb)
    return b if b in schedule else Op("I", stage, mb)


# ---- text and JSON -------------------------------------------------------------------------

def format_lowered(lowered: Lowered) -> str:
    """The readable text form (`pipeirc compile --emit lowered`)."""
    lines = [f"# lowered {lowered.name}: {lowered.ranks} ranks, {lowered.stages} stages, "
             f"{lowered.microbatches} micro-batches, accumulate {lowered.accumulate}"
             f"{', overlap' if lowered.overlap else ''}",
             f"# placement {' '.join(map(str, lowered.placement))}"]
    for r, prog in enumerate(lowered.programs):
        lines.append(f"rank {r} {{")
        lines.extend(f"  {i:3d}  {ins}" for i, ins in enumerate(prog))
        lines.append("}")
    return "\n".join(lines) + "\n"


def _instr_json(ins: Instr) -> dict[str, Any]:
    d = {"i": ins.mnemonic}
    for f in fields(ins):
        value = getattr(ins, f.name)
        d[f.name] = [_instr_json(v) for v in value] if isinstance(value, tuple) else value
    return d


def to_json(lowered: Lowered) -> dict[str, Any]:
    d = asdict(lowered)
    d["programs"] = [[_instr_json(i) for i in prog] for prog in lowered.programs]
    d["placement"] = list(lowered.placement)
    return {"format": "pipeir-lowered", "version": 1, **d}


def _instr_from(d: Mapping[str, Any]) -> Instr:
    cls = _BY_MNEMONIC.get(d.get("i", ""))
    if cls is None:
        raise UsageError(f"lowered JSON: unknown instruction {d.get('i')!r}")
    kw = {k: v for k, v in d.items() if k != "i"}
    if cls is Batch:
        kw["posts"] = tuple(_instr_from(p) for p in kw.get("posts", ()))
    try:
        return cls(**kw)  # type: ignore[no-any-return]
    except TypeError as e:
        raise UsageError(f"lowered JSON: bad {d.get('i')} instruction: {e}") from None


def from_json(data: Mapping[str, Any]) -> Lowered:
    """Read what `to_json` wrote; malformed input is a UsageError."""
    if not isinstance(data, Mapping) or data.get("format") != "pipeir-lowered":
        raise UsageError("not a pipeir lowered-program JSON file (format != pipeir-lowered)")
    try:
        return Lowered(str(data["name"]), int(data["ranks"]), int(data["stages"]),
                       int(data["microbatches"]), int(data["accumulate"]),
                       tuple(int(x) for x in data["placement"]),
                       tuple(tuple(_instr_from(i) for i in prog) for prog in data["programs"]),
                       bool(data.get("overlap", False)))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise UsageError(f"lowered JSON: missing or bad field: {e}") from None


def dumps(lowered: Lowered) -> str:
    return json.dumps(to_json(lowered), indent=1) + "\n"
