"""Lowering: a verified `Schedule` becomes one straight-line instruction program per rank.

A lowered program is one optimizer step: `zero-grad`, `accumulate` rounds of the schedule
(round r works on micro-batches r*m .. r*m+m-1 of the step's batch), then `step`.

NOTE (why the blocking programs cannot deadlock): communication is placed by the simulator's
timing of the schedule (`pipeir.sim.engine.Timing`, under the compile's cost model; unit
costs F=1, B=2, I=W=1 unless given). Every cross-rank tensor
is a blocking `send` at the time its producer ends, an `irecv` on the receiver no later than
that (before the op the receiver is running then) and a `wait-recv` right before the consumer;
compute sits at its start time. Sorting all events by time (posts, then sends, then compute at
equal times) gives one global order in which each rank's projection is its program, every send
finds its receive posted and every wait its send done. Executing that global order is a valid
run under rendezvous semantics, so no rank can wait forever; `pipeir.backend.commcheck` proves
it again on the emitted programs. Transfers between a pair of ranks are posted in the same
order on both sides (per-peer FIFO, as NCCL needs).

Gradient reductions (data parallelism): R(s) becomes `reduce-grad stage=s` where the rank
reaches it in the last round of the step (an asynchronous all-reduce of the stage's gradients
on the data-parallel group; it never blocks the rank), and `wait-reduce stage=s` right before
the optimizer step. Earlier rounds of a step with `accumulate` > 1 reduce nothing: the
gradients are still accumulating. Every replica runs the same program, so the replicas issue
their all-reduces in the same order and they cannot deadlock each other.

The two ops of an overlapped pair are lowered back to back as one unit: the receives of both
are waited before the first, the sends of both follow the second, and the instructions after
the pair's first carry `paired` so that later passes put nothing in between.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from graphlib import TopologicalSorter
from typing import Any, Literal, get_args, get_type_hints

from pipeir import limits
from pipeir.diagnostics import UsageError
from pipeir.ops import Op
from pipeir.schedule import Schedule, pair_waits
from pipeir.sim.costs import CostModel
from pipeir.sim.engine import Timing
from pipeir.verify import verify

Tensor = Literal["act", "grad"]
Part = Literal["input", "target"]

@dataclass(frozen=True)
class Instr:
    """Base of every instruction. `op` and `at` name the schedule op and `.sched` line
    (`file:line`) it came from, so errors at run time can point back into the source."""

    op: str = field(default="", kw_only=True)
    at: str = field(default="", kw_only=True)
    #: Runs back to back with the instruction before it (inside an overlapped pair): passes
    #: must not place anything in between.
    paired: bool = field(default=False, kw_only=True)

    @property
    def mnemonic(self) -> str:
        return _MNEMONICS[type(self)]

    def operands(self) -> str:
        """The instruction's own fields, as the text form prints them."""
        parts = []
        for f in fields(self):
            if f.name in ("op", "at", "paired"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = "[" + "; ".join(f"{v.mnemonic} {v.operands()}" for v in value) + "]"
            parts.append(f"{f.name}={value}")
        if self.paired:
            parts.append("paired")
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
class ForwardCheckpoint(Forward):
    """A forward that keeps only its input (and the RNG state), not its activations (FC).
    What it sends on is a Forward's output, so checks that follow tensors treat it as one."""


@dataclass(frozen=True)
class Recompute(Instr):
    """Run a checkpointed forward again, with its RNG state, keeping the activations (RC)."""

    stage: int
    mb: int


@dataclass(frozen=True)
class Offload(Instr):
    """Start moving a forward's saved activations to host memory (OFF, on the copy stream)."""

    stage: int
    mb: int


@dataclass(frozen=True)
class Reload(Instr):
    """Start moving offloaded activations back; the backward waits for them (RELOAD)."""

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
class ReduceGrad(Instr):
    """Start the all-reduce (mean) of `stage`'s gradients across the data-parallel replicas;
    asynchronous (torch's REDUCE_GRAD)."""

    stage: int


@dataclass(frozen=True)
class WaitReduce(Instr):
    """Wait for `stage`'s gradient all-reduce (before the optimizer step)."""

    stage: int


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
    Loss: "loss", Backward: "backward", ForwardCheckpoint: "forward-checkpoint",
    Recompute: "recompute", Offload: "offload", Reload: "reload", BackwardInput: "backward-input",
    BackwardWeight: "backward-weight", Handoff: "handoff", Send: "send", Recv: "recv",
    ISend: "isend", IRecv: "irecv", WaitSend: "wait-send", WaitRecv: "wait-recv",
    Batch: "batch", ReduceGrad: "reduce-grad", WaitReduce: "wait-reduce",
}
_BY_MNEMONIC: dict[str, type] = {v: k for k, v in _MNEMONICS.items()}

#: Instructions that do model compute (their time is "busy" in the measured bubble).
COMPUTE: tuple[type, ...] = (Forward, Loss, Backward, BackwardInput, BackwardWeight,
                             Recompute)


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

    def reduced_stages(self) -> set[int]:
        """The stages some `reduce-grad` all-reduces: every stage where the programs are for
        data parallelism (`commcheck` proves it), none where they are not."""
        return {i.stage for prog in self.programs for i in prog if isinstance(i, ReduceGrad)}

    def with_programs(self, programs: Sequence[Sequence[Instr]], overlap: bool) -> Lowered:
        return Lowered(self.name, self.ranks, self.stages, self.microbatches, self.accumulate,
                       self.placement, tuple(tuple(p) for p in programs), overlap)


def tag_of(tensor: Tensor, stage: int, mb: int, stages: int) -> int:
    """A tag unique per tensor within a step (gloo matches on it; NCCL ignores it)."""
    return (mb * stages + stage) * 2 + (1 if tensor == "grad" else 0)


# ---- lowering ----------------------------------------------------------------------------------

def lower(schedule: Schedule, costs: CostModel | None = None) -> Lowered:
    """Lower a schedule (verified here first) to per-rank instruction programs; `costs`
    (default: unit costs) only decide where communication is placed, never correctness."""
    verify(schedule)
    cfg = schedule.config
    limits.check_lowering(f"lowering '{schedule.name}'" + (
        f" ({cfg.accumulate} rounds: accumulate)" if cfg.accumulate > 1 else ""),
        len(schedule.graph), cfg.accumulate)
    times, topo = _times(schedule, costs if costs is not None else CostModel())
    rounds = [_lower_round(schedule, times, topo, r) for r in range(cfg.accumulate)]
    programs = []
    for rank in range(cfg.ranks):
        prog: list[Instr] = [ZeroGrad()]
        for rnd in rounds:
            prog.extend(rnd[rank])
        prog.extend(WaitReduce(i.stage, op=i.op, at=i.at) for i in prog
                    if isinstance(i, ReduceGrad))
        prog.append(OptimizerStep())
        programs.append(tuple(_post_early(prog)))
    return Lowered(schedule.name, cfg.ranks, cfg.stages, cfg.microbatches, cfg.accumulate,
                   cfg.placement, tuple(programs))


def _post_early(prog: list[Instr]) -> list[Instr]:
    """Each `irecv` moved up to just after the `wait-recv` of the previous receive from the
    same peer (the first one to the start of the step), unless it already is earlier.

    NOTE: a receive posted one op ahead of the simulated send time is not enough at run time:
    costs differ from the unit costs, and a receiver that is behind makes every blocking send
    to it wait (about 1 ms per send on gloo with 4 ranks on 2 cores, against 0.05 ms when the
    receive is posted). Keeping one receive posted per peer at all times makes a send wait only
    when its receiver has not yet consumed the previous message from that sender. Posting
    earlier never makes a rank block longer, keeps each peer's posting order, and holds at
    most one receive buffer per peer."""
    key: list[tuple[int, int, int]] = []
    after_wait: dict[int, int] = {}  # peer -> index after its last wait-recv so far
    for i, ins in enumerate(prog):
        if isinstance(ins, IRecv):
            key.append((min(i, after_wait.get(ins.peer, 1)), 0, i))
        else:
            key.append((i, 1, i))
            if isinstance(ins, WaitRecv):
                after_wait[ins.peer] = i + 1
    return [prog[k[2]] for k in sorted(key)]


def _times(schedule: Schedule, costs: CostModel
           ) -> tuple[dict[Op, tuple[float, float]], dict[Op, int]]:
    """Start and end of every op as the simulator times it (overlapped communication). The
    two ops of an overlapped pair run as one unit: both get the pair's start and end (their
    outputs leave when the pair is done). Also each op's place in a topological order, which
    breaks ties between events at one time (`_lower_round`, `_topological`)."""
    timing = Timing(schedule, costs)
    if not timing.complete:  # pragma: no cover - verify() rejected deadlocks already
        raise AssertionError("schedule deadlocks after verification")
    t = timing.sweep([costs.cost(op) for op in timing.ops])
    times = {op: (t.start[i], t.end[i]) for i, op in enumerate(timing.ops)}
    # a reduction is issued when its rank reaches it (its channel may start it later)
    for prog in schedule.programs:
        reached = 0.0
        for op in prog:
            if op.kind == "R":
                times[op] = (reached, reached)
            else:
                reached = times[op][1]
    for first, second in schedule.pairs:
        times[first] = times[second] = (times[first][0], times[second][1])
    return times, _topological(schedule)


def _topological(schedule: Schedule) -> dict[Op, int]:
    """Each op's place in a topological order of the schedule's edges (program order on
    every rank, side-channel ops included, and data) and of its overlapped pairs' waits (a
    pair's first op waits for its second's inputs). `Timing.order` will not do: for the
    sweep, a compute after an offload does not wait for it, so offloads sorted after it."""
    deps: dict[Op, set[Op]] = {op: set(ps) for op, ps in schedule.graph._pred.items()}
    for p, first, _ in pair_waits(schedule):
        deps[first].add(p)
    return {op: k for k, op in enumerate(TopologicalSorter(deps).static_order())}


def _unit(schedule: Schedule, op: Op) -> tuple[Op, ...]:
    """`op` alone, or `op` and its partner when `op` opens an overlapped pair."""
    partner = schedule.graph.nodes[op].get("pair_next")
    return (op, partner) if partner is not None else (op,)


def _in_progress(spans: list[tuple[float, float]], t: float) -> float:
    """The start of the op running at time `t` in `spans` (sorted), or `t` when none is."""
    k = bisect_right(spans, (t, float("inf"))) - 1
    if k >= 0 and spans[k][0] < t < spans[k][1]:
        return spans[k][0]
    return t


def _lower_round(schedule: Schedule, times: Mapping[Op, tuple[float, float]],
                 topo: Mapping[Op, int], rnd: int) -> list[list[Instr]]:
    """One round's instructions per rank, in the global event order (see the module NOTE).

    NOTE (blocking placement): a blocking send at time t waits for its receiver to post the
    matching receive; a receiver busy with an op at t would make the sender idle until that op
    ends, which the simulator's blocking model does not charge. So the receive is posted
    (`irecv`) before the op the receiver is running at t (`_post_early` then moves it earlier
    still) and waited for (`wait-recv`) right before the op that consumes it.

    NOTE (ties): events are sorted by time, then posts first, then by the op's place in a
    topological order, its compute before its sends. Sorting all sends at a time before all
    computes at it put a zero-cost op's send (at its end) before its own compute (at its
    start, the same time): `--set B=0` failed the check. The topological place keeps every
    send after its producer and before its consumer, and a rank's ops in program order."""
    cfg = schedule.config
    last = cfg.stages - 1
    offset = rnd * cfg.microbatches
    scale = 1.0 / (cfg.microbatches * cfg.accumulate)
    busy = [sorted(times[op] for op in prog if op.kind != "R") for prog in schedule.programs]
    final = rnd == cfg.accumulate - 1  # reductions run once per step, after the last round
    # (sort key, the op whose receives are waited for first, or None; the instructions)
    events: list[tuple[tuple[Any, ...], Op | None, list[tuple[int, Instr]]]] = []
    waits: dict[Op, list[Instr]] = {}

    def origin(op: Op) -> dict[str, Any]:
        span = schedule.span_of(op)
        return {"op": str(op), "at": f"{span.file}:{span.line}" if span is not None else ""}

    for rank, prog in enumerate(schedule.programs):
        for pos, op in enumerate(prog):
            if schedule.graph.nodes[op].get("pair_prev") is not None:
                continue  # lowered with the first op of its pair
            if op.kind == "R":
                if final:
                    events.append(((times[op][0], 0, topo[op], 0, rank, pos), None,
                                   [(rank, ReduceGrad(op.stage, **origin(op)))]))
                continue
            unit = _unit(schedule, op)
            start, end = times[op][0], times[unit[-1]][1]
            body: list[Instr] = []
            after: list[Instr] = []
            for k, o in enumerate(unit):
                body += compute_instrs(o, o.mb + offset, last, scale, origin(o))
                s, mb, oo = o.stage, o.mb + offset, origin(o)
                for tensor, dst in outputs_of(o, cfg.stages):
                    peer = cfg.placement[dst]
                    tag = tag_of(tensor, s, mb, cfg.stages)
                    if peer == rank:
                        after.append(Handoff(tensor, s, mb, **oo))
                        continue
                    consumer = consumer_of(schedule, tensor, dst, o.mb)
                    co = origin(consumer)
                    post = _in_progress(busy[peer], end)
                    events.append(((end, 0, topo[op], 1, rank, pos, k, dst), None, [
                        (rank, Send(tensor, s, mb, peer, tag, **oo))]))
                    events.append(((post, -1, end, rank, pos, k, dst), None, [
                        (peer, IRecv(tensor, s, mb, rank, tag, **co))]))
                    waits.setdefault(_first_of(schedule, consumer), []).append(
                        WaitRecv(tensor, s, mb, rank, tag, **co))
            if len(unit) > 1:  # a pair: nothing may come between its instructions
                body = body[:1] + [replace(b, paired=True) for b in body[1:]]
            events.append(((start, 0, topo[op], 0, rank, pos), op, [(rank, b) for b in body]))
            if after:
                events.append(((end, 0, topo[op], 1, rank, pos, -1), None,
                               [(rank, b) for b in after]))
    out: list[list[Instr]] = [[] for _ in range(cfg.ranks)]
    for _, computed, items in sorted(events, key=lambda e: e[0]):
        if computed is not None:  # compute: its waits first (in the order their sends happen)
            out[items[0][0]].extend(waits.pop(computed, []))
        for r, ins in items:
            out[r].append(ins)
    return out


def _first_of(schedule: Schedule, op: Op) -> Op:
    """The op that opens `op`'s overlapped pair (or `op`): waits go before the whole pair."""
    prev = schedule.graph.nodes[op].get("pair_prev")
    return prev if prev is not None else op


def compute_instrs(op: Op, mb: int, last: int, scale: float, o: dict[str, Any]) -> list[Instr]:
    """The compute instructions of one op."""
    s = op.stage
    if op.kind == "F" or op.kind == "FC":
        body: list[Instr] = [Load(mb, "input", **o)] if s == 0 else []
        body.append(Forward(s, mb, **o) if op.kind == "F" else ForwardCheckpoint(s, mb, **o))
        if s == last:
            body += [Load(mb, "target", **o), Loss(s, mb, scale, **o)]
        return body
    if op.kind == "B":
        return [Backward(s, mb, **o)]
    if op.kind == "I":
        return [BackwardInput(s, mb, **o)]
    if op.kind == "RC":
        return [Recompute(s, mb, **o)]
    if op.kind == "OFF":
        return [Offload(s, mb, **o)]
    if op.kind == "RELOAD":
        return [Reload(s, mb, **o)]
    return [BackwardWeight(s, mb, **o)]


def outputs_of(op: Op, stages: int) -> list[tuple[Tensor, int]]:
    """The tensors `op` produces for another stage: (kind, consuming stage)."""
    if (op.kind == "F" or op.kind == "FC") and op.stage + 1 < stages:
        return [("act", op.stage + 1)]
    if op.kind in ("B", "I") and op.stage > 0:
        return [("grad", op.stage - 1)]
    return []


def consumer_of(schedule: Schedule, tensor: Tensor, stage: int, mb: int) -> Op:
    if tensor == "act":
        f = Op("F", stage, mb)
        return f if f in schedule else Op("FC", stage, mb)
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
    d: dict[str, Any] = {"i": ins.mnemonic}
    for f in fields(ins):
        value = getattr(ins, f.name)
        if f.name == "paired" and not value:
            continue
        d[f.name] = [_instr_json(v) for v in value] if isinstance(value, tuple) else value
    return d


def to_json(lowered: Lowered) -> dict[str, Any]:
    d = asdict(lowered)
    d["programs"] = [[_instr_json(i) for i in prog] for prog in lowered.programs]
    d["placement"] = list(lowered.placement)
    return {"format": "pipeir-lowered", "version": 1, **d}


# NOTE (reading lowered JSON): a lowered.json may be edited by hand, so `from_json` checks
# its shape and types before building anything: the rules of `commcheck` compare stages and
# micro-batches with numbers, and a string or list there was a TypeError traceback. Integers
# are 64-bit and non-negative (bool, a subclass of int, is refused), the header's sizes are
# positive and agree with the placement and the number of programs. Ranges against the header
# (a micro-batch past the count, a peer that runs no such stage) are findings of the checks,
# which name the instruction in their own words.

#: Per instruction class, its fields: (name, type, required), from the dataclass itself so
#: that a new instruction or field is read without touching the reader.
_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {
    cls: tuple((f.name, get_type_hints(cls)[f.name],
                f.default is MISSING and f.default_factory is MISSING) for f in fields(cls))
    for cls in _MNEMONICS}
_SIZES = ("ranks", "stages", "microbatches", "accumulate")


def _shown(value: object) -> str:
    """A JSON value as the file spells it, shortened."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _wanted(value: object, hint: Any) -> str | None:
    """What a field of type `hint` must be, when `value` is not that; None when it is."""
    if hint is int:
        ok = type(value) is int and 0 <= value <= limits.MAX_INT
        return None if ok else "a non-negative integer (64-bit)"
    if hint is float:
        ok = (type(value) is float and math.isfinite(value)) or \
            (type(value) is int and not limits.int_overflow(value))
        return None if ok else "a finite number"
    if hint is str:
        return None if type(value) is str else "a string"
    if hint is bool:
        return None if type(value) is bool else "true or false"
    choices = get_args(hint)  # a Literal
    if type(value) is str and value in choices:
        return None
    return "one of " + ", ".join(json.dumps(c) for c in choices)


def _instr_from(d: object, where: str, in_batch: bool = False) -> Instr:
    """One instruction object; `where` names it ("FILE: rank 0, instruction 3")."""
    if type(d) is not dict:
        raise UsageError(f"{where}: expected an instruction object {{\"i\": ...}}, got "
                         f"{_shown(d)}")
    name = d.get("i")
    cls = _BY_MNEMONIC.get(name) if type(name) is str else None
    if cls is None:
        raise UsageError(f"{where}: unknown instruction {_shown(name)} (field \"i\")")
    where = f"{where} ({name})"
    if in_batch and cls not in (ISend, IRecv):
        raise UsageError(f"{where}: a batch holds only isend and irecv posts")
    known = {n for n, _, _ in _FIELDS[cls]}
    extra = [k for k in d if k != "i" and k not in known]
    if extra:
        raise UsageError(f"{where}: unknown field {_shown(extra[0])} (a {name} has "
                         f"{', '.join(sorted(known))})")
    kw: dict[str, Any] = {}
    for field_name, hint, required in _FIELDS[cls]:
        if field_name not in d:
            if required:
                raise UsageError(f"{where}: missing field \"{field_name}\"")
            continue
        value = d[field_name]
        if field_name == "posts":
            if type(value) is not list or not value:
                raise UsageError(f"{where}: \"posts\" must be a non-empty list of isend and "
                                 f"irecv objects, got {_shown(value)}")
            kw["posts"] = tuple(_instr_from(p, f"{where}, post {j}", in_batch=True)
                                for j, p in enumerate(value))
            continue
        want = _wanted(value, hint)
        if want is not None:
            raise UsageError(f"{where}: \"{field_name}\" must be {want}, got {_shown(value)}")
        kw[field_name] = value
    return cls(**kw)  # type: ignore[no-any-return]


def _header(data: object, where: str) -> dict[str, Any]:
    """The checked top-level object (module NOTE on reading lowered JSON)."""
    if type(data) is not dict or data.get("format") != "pipeir-lowered":
        raise UsageError(f"{where}: not a pipeir lowered-program JSON file "
                         "(format != pipeir-lowered)")
    if "version" not in data:
        raise UsageError(f"{where}: missing field \"version\"")
    if data["version"] != 1 or type(data["version"]) is not int:
        raise UsageError(f"{where}: \"version\" {_shown(data['version'])} is not one this "
                         "pipeir reads (1)")
    for key in ("name", *_SIZES, "placement", "programs"):
        if key not in data:
            raise UsageError(f"{where}: missing field \"{key}\"")
    known = ("format", "version", *(f.name for f in fields(Lowered)))
    extra = [k for k in data if k not in known]
    if extra:  # a "dp": 2 here reads as if it meant something; nothing reads it
        raise UsageError(f"{where}: unknown field {_shown(extra[0])} (the header has "
                         f"{', '.join(known)})")
    for key, hint in (("name", str), ("overlap", bool)):
        want = _wanted(data[key], hint) if key in data else None
        if want is not None:
            raise UsageError(f"{where}: \"{key}\" must be {want}, got {_shown(data[key])}")
    for key in _SIZES:
        value = data[key]
        if type(value) is not int or not 1 <= value <= limits.MAX_INT:
            raise UsageError(f"{where}: \"{key}\" must be a positive integer (64-bit), got "
                             f"{_shown(value)}")
    ranks, stages = data["ranks"], data["stages"]
    placement, programs = data["placement"], data["programs"]
    if type(programs) is not list:
        raise UsageError(f"{where}: \"programs\" must be a list of programs (one per rank), "
                         f"got {_shown(programs)}")
    if len(programs) != ranks:
        raise UsageError(f"{where}: \"ranks\" is {ranks}, but there are {len(programs)} "
                         "programs (one per rank)")
    if type(placement) is not list or len(placement) != stages:
        raise UsageError(f"{where}: \"placement\" must be a list of {stages} ranks (one per "
                         f"stage, \"stages\": {stages}), got {_shown(placement)}")
    for s, r in enumerate(placement):
        if type(r) is not int or not 0 <= r < ranks:
            raise UsageError(f"{where}: placement of stage {s} must be a rank 0 to {ranks - 1} "
                             f"(\"ranks\": {ranks}), got {_shown(r)}")
    owners = set(placement)
    idle = next((r for r in range(ranks) if r not in owners), None)
    if idle is not None:  # as PipelineConfig: a rank that owns no stage is a wrong "ranks"
        raise UsageError(f"{where}: rank {idle} owns no stage ({stages} stages on {ranks} "
                         f"ranks, \"placement\": {_shown(placement)})")
    for r, prog in enumerate(programs):
        if type(prog) is not list:
            raise UsageError(f"{where}: the program of rank {r} must be a list of "
                             f"instructions, got {_shown(prog)}")
    # NOTE: the checks run over every (stage, micro-batch): a header that claims far more
    # than its programs hold would make them loop for hours over what cannot be there
    mbs, have = data["microbatches"] * data["accumulate"], sum(map(len, programs))
    if 2 * stages * mbs > have:
        raise UsageError(f"{where}: \"stages\" {stages} x \"microbatches\" "
                         f"{data['microbatches']} x \"accumulate\" {data['accumulate']} need "
                         f"{2 * stages * mbs:,} computes at least (a forward and a backward "
                         f"each), but the programs hold {have:,} instructions in all")
    return data


def from_json(data: object, where: str = "lowered JSON") -> Lowered:
    """Read what `to_json` wrote; malformed input is a UsageError naming `where` (the file),
    the rank, the instruction and the field."""
    d = _header(data, where)
    programs = tuple(tuple(_instr_from(ins, f"{where}: rank {r}, instruction {pc}")
                           for pc, ins in enumerate(prog))
                     for r, prog in enumerate(d["programs"]))
    return Lowered(d["name"], d["ranks"], d["stages"], d["microbatches"], d["accumulate"],
                   tuple(d["placement"]), programs, d.get("overlap", False))


def dumps(lowered: Lowered) -> str:
    return json.dumps(to_json(lowered), indent=1) + "\n"
