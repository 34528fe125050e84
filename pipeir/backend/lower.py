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

Lowered for `overlap` (`lower_verified`'s `split`), which places every receive itself, a
schedule with no offload or reload is not timed: program order gives the same events
(`_in_order`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from pipeir import limits
from pipeir._gc import paused_gc
from pipeir.backend.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Comm,
    Forward,
    ForwardCheckpoint,
    Handoff,
    Instr,
    IRecv,
    Load,
    Loss,
    Lowered,
    Offload,
    OptimizerStep,
    Recompute,
    ReduceGrad,
    Reload,
    Send,
    Tensor,
    WaitRecv,
    WaitReduce,
    ZeroGrad,
    builder,
    tag_of,
)
from pipeir.backend.split import Split
from pipeir.ops import CHANNEL, Op
from pipeir.schedule import Schedule
from pipeir.sim.costs import CostModel
from pipeir.sim.engine import Timing
from pipeir.verify import verify


def lower(schedule: Schedule, costs: CostModel | None = None) -> Lowered:
    """Lower a schedule (verified here first) to per-rank instruction programs; `costs`
    (default: unit costs) only decide where communication is placed, never correctness."""
    verify(schedule)
    return lower_verified(schedule, costs)


@paused_gc()  # (pipeir._gc: ~10 objects per op, no cycles)
def lower_verified(schedule: Schedule, costs: CostModel | None = None,
                   then: Callable[[tuple[Instr, ...]], tuple[Instr, ...]] | None = None,
                   split: Callable[[Split], tuple[Instr, ...]] | None = None) -> Lowered:
    """`lower` of a schedule its caller has just verified: the pass manager verifies every
    pass's output (under the costs' activation sizes, as `check` counts), and verifying a
    262k-op schedule again was 0.4 to 0.6 s of its compile.

    `then` rewrites each rank's program as it is made (a rank-local lowered pass, which the
    pass manager hands over): the programs it returns are `then` applied to each of
    `lower`'s. NOTE (memory): every rank's lowered program beside every rewritten one was a
    large compile's peak; here each is let go as its rewrite is made. `split` is `then` for
    a pass that places every receive itself (`overlap`): it is given what `split_program`
    would find in each of `lower`'s programs, which is made without the program."""
    if then is not None and split is not None:
        raise TypeError("lower_verified: give `then` or `split`, not both")
    cfg = schedule.config
    limits.check_lowering(f"lowering '{schedule.name}'" + (
        f" ({cfg.accumulate} rounds: accumulate)" if cfg.accumulate > 1 else ""),
        len(schedule), cfg.accumulate)
    times = _times(schedule, costs if costs is not None else CostModel()) \
        if split is None or any(op.kind in _COPY for op in schedule) else _in_order(schedule)
    # NOTE (memory): what lowering still needs of the schedule's numbered index (the
    # topological places, the pairs by number) is in `times`; the rest (edges, order, the
    # op -> number dict) would be a third of a large lowering's peak. Dropped here (its next
    # user builds it again: compile and `check` have none).
    schedule.drop_index()
    ops = _Ops(schedule, times.pairs)
    rounds = [_lower_round(schedule, times, r, ops, split is not None)
              for r in range(cfg.accumulate)]
    del times, ops
    programs = []
    for rank in range(cfg.ranks):
        prog: list[Instr] = [ZeroGrad()]
        recvs: list[Comm] = []
        needs: list[int] = []
        for rnd in rounds:
            mine = rnd[rank]
            if isinstance(mine, Split):
                shift = len(prog)
                recvs += mine.recvs
                needs += [k + shift for k in mine.needs]
                prog.extend(mine.rest)
            else:
                prog.extend(mine)
            rnd[rank] = []  # (let go as the programs are made: they hold it all)
        prog.extend(WaitReduce(i.stage, op=i.op, at=i.at) for i in prog
                    if isinstance(i, ReduceGrad))
        prog.append(OptimizerStep())
        if split is not None:
            programs.append(split(Split(prog, recvs, needs)))
            continue
        done = tuple(_post_early(prog))
        programs.append(done if then is None else then(done))
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
    # NOTE: the sort key (place, receives first, index) packed into one int: sorting ints
    # is several times cheaper than sorting tuples, and holds no tuple per instruction
    n = len(prog)
    key: list[int] = []
    after_wait: dict[int, int] = {}  # peer -> index after its last wait-recv so far
    for i, ins in enumerate(prog):
        t = type(ins)
        if t is IRecv:
            key.append(2 * min(i, after_wait.get(ins.peer, 1)) * n + i)  # type: ignore[attr-defined]
        else:
            key.append((2 * i + 1) * n + i)
            if t is WaitRecv:
                after_wait[ins.peer] = i + 1  # type: ignore[attr-defined]
    key.sort()
    return [prog[k % n] for k in key]


@dataclass(frozen=True, slots=True)
class _Times:
    """When each op runs, by its number in `Schedule.deps` (lists, not dicts keyed by op: a
    large lowering's peak memory is these and its events), and per rank the spans of its
    computes, sorted (`_in_progress`)."""

    #: the overlapped pairs, by number
    pairs: list[tuple[int, int]]
    start: Sequence[float]
    end: Sequence[float]
    #: each op's place in the topological order (`_times`)
    place: Sequence[int]
    busy_starts: list[Sequence[float]]
    busy_ends: list[Sequence[float]]


def _times(schedule: Schedule, costs: CostModel) -> _Times:
    """Start and end of every op as the simulator times it (overlapped communication). The
    two ops of an overlapped pair run as one unit: both get the pair's start and end (their
    outputs leave when the pair is done). Also each op's place in a topological order, which
    breaks ties between events at one time (`_lower_round`): the schedule's cached order
    (`Schedule.deps`), over program order on every rank (side-channel ops included), data,
    and overlapped pairs' waits; the lowered programs depend on it."""
    timing = Timing(schedule, costs)
    if not timing.complete:  # pragma: no cover - verify() rejected deadlocks already
        raise AssertionError("schedule deadlocks after verification")
    t = timing.sweep([costs.cost(op) for op in timing.ops])
    deps = schedule.deps
    # (as machine floats, numbered as deps: a float object per time was 64 bytes per op of
    # a large lowering's peak)
    start, end = array("d", t.start), array("d", t.end)
    del t
    # a reduction is issued when its rank reaches it (its channel may start it later)
    computes: list[list[int]] = []
    i = 0  # (deps numbers ops in program order, rank by rank)
    for prog in schedule.programs:
        reached = 0.0
        mine = []
        for op in prog:
            if op.kind == "R":
                start[i] = end[i] = reached
            else:
                reached = end[i]
                mine.append(i)
            i += 1
        computes.append(mine)
    pairs = [(deps.index[first], deps.index[second]) for first, second in schedule.pairs]
    for i, j in pairs:
        start[i], end[i], start[j], end[j] = start[i], end[j], start[i], end[j]
    starts: list[Sequence[float]] = []
    ends: list[Sequence[float]] = []
    for mine in computes:
        mine.sort(key=lambda i: (start[i], end[i]))
        starts.append(array("d", [start[i] for i in mine]))
        ends.append(array("d", [end[i] for i in mine]))
    return _Times(pairs, start, end, deps.place(), starts, ends)


#: Kinds that run on a rank's copy channel, beside its compute (`sim.engine`).
_COPY: Final = frozenset(k for k, channel in CHANNEL.items() if channel == "copy")


def _in_order(schedule: Schedule) -> _Times:
    """`_times` for a split lowering (`lower_verified`'s `split`) of a schedule with no op on a
    copy channel: each op's number in `Schedule.deps` stands for its start, end and place.

    NOTE (why no timing is needed): a rank's computes run one after another in program order
    (the simulator starts each once the one before it has ended, `start >= end`, ties broken
    by the topological place, which follows program order), a send or hand-off leaves at its
    producer's end, before the next compute's start, and a reduction is issued at its rank's
    last compute's end (`_times`). So `_lower_round`'s sort puts each rank's events in program
    order, each op's compute, then its hand-offs, then its sends, whatever the costs: op
    numbers (program order, rank by rank) sort the same way. What the costs decide is where
    a blocking program posts and waits its receives, which a split lowering leaves to its
    pass. An offload or reload runs on the copy channel, beside the computes after it: its
    instructions go where its time falls, so a schedule with one is timed. (At p = 64: about
    a second of lowering's 3.2 to 4.0 s, the timing and the sort of each rank's events, now
    over keys in order but for each op's compute and sends.)"""
    deps = schedule.deps
    n = len(deps.ops)
    number = array("d", range(n))
    pairs = [(deps.index[first], deps.index[second]) for first, second in schedule.pairs]
    for i, j in pairs:  # (a pair's ops run as one unit: `_times`)
        number[j] = number[i]
    return _Times(pairs, number, number, range(n), [], [])


def _in_progress(starts: Sequence[float], ends: Sequence[float], t: float) -> float:
    """The start of the op running at time `t` among spans (`starts`, `ends`: sorted by start,
    then end), or `t` when none is."""
    k = bisect_right(starts, t) - 1
    if k >= 0 and starts[k] < t < ends[k]:
        return starts[k]
    return t


#: a receive until its receiver's program is emitted (without `split`): its `irecv`'s fields
#: (tensor, producing stage, micro-batch, sending rank, tag, and the consuming op's name and
#: `.sched` line), as a list (an event's payload that is a list of strings first: a receive)
_Recv = list[Any]

#: the kinds that consume a tensor from another stage, and their slot in `_Ops._consumers`
_CONSUMING: Final = {"F": 0, "FC": 1, "B": 2, "I": 3}


class _Ops:
    """What lowering looks up per op, read from the schedule once, by the op's number
    (`Schedule.deps` numbers ops in program order, rank by rank: a rank's op at `pos` is
    number `first + pos`): overlapped pairs, the consumer of a tensor, and each op's origin
    (name and `.sched` line).

    NOTE: looking these up through the graph's node views per op (a view object, a dict
    per look-up, and an `Op` built and compared to find a consumer) was a third of lowering a
    large schedule, and dicts keyed by op still hash it (a Python-level `__hash__`) several
    times per op; lists and flags by number do neither, and a large lowering's peak memory
    holds a dict less."""

    def __init__(self, schedule: Schedule, pairs: list[tuple[int, int]]) -> None:
        cfg = schedule.config
        self.ops = [op for prog in schedule.programs for op in prog]
        n = len(self.ops)
        #: 1 where the op opens an overlapped pair (its partner is the next number)
        self.opens = bytearray(n)
        #: 1 where the op closes one (its partner is the number before)
        self.closes = bytearray(n)
        for first, second in pairs:
            self.opens[first] = self.closes[second] = 1
        self._mbs = cfg.microbatches
        self._stages = cfg.stages
        #: every tag of the step (`tag_of` numbers them 0, 1, ...), made together: a send and
        #: its receive share one int. NOTE (memory): an int above 256 is an object, and
        #: made one by one among the lowering's passing objects of its size they left the
        #: allocator's pools of them a third full for the rest of the compile.
        self.tags = list(range(2 * cfg.stages * cfg.microbatches * cfg.accumulate))
        self._consumers = consumers = [-1] * (4 * cfg.stages * cfg.microbatches)
        stages, mbs = cfg.stages, cfg.microbatches
        for i, op in enumerate(self.ops):
            k = _CONSUMING.get(op.kind)
            if k is not None:  # (`_slot`, inline: every op passes here)
                consumers[(k * stages + op.stage) * mbs + op.mb] = i
        #: each op's name and `.sched` line (`file:line`, "" where it has none), shared by
        #: its instructions: one string each per op, not per instruction. NOTE: made here
        #: for all ops at once (every op is lowered): a call per look-up, to make them
        #: lazily, was a tenth of lowering a large schedule.
        self.names = list(map(str, self.ops))
        lines: dict[tuple[str, int], str] = {}
        self.ats = ats = [""] * n
        for i, span in enumerate(map(schedule.spans().__getitem__, self.ops)):
            if span is not None:
                line = (span.file, span.line)
                at = lines.get(line)
                if at is None:
                    at = lines[line] = f"{span.file}:{span.line}"
                ats[i] = at

    def _slot(self, k: int, stage: int, mb: int) -> int:
        return (k * self._stages + stage) * self._mbs + mb

    def consumer(self, tensor: Tensor, stage: int, mb: int) -> int:
        """The number of the op of `stage` that consumes `tensor` of micro-batch `mb`."""
        first, second = (0, 1) if tensor == "act" else (2, 3)
        found = self._consumers[self._slot(first, stage, mb)]
        if found < 0:
            found = self._consumers[self._slot(second, stage, mb)]
        if found < 0:  # pragma: no cover - verify() rejected incomplete schedules
            raise AssertionError(f"no consumer of the {tensor} of stage {stage}, mb {mb}")
        return found


def _lower_round(schedule: Schedule, times: _Times, rnd: int, ops: _Ops, split: bool
                 ) -> list[list[Instr] | Split]:
    """One round's instructions per rank, in the global event order (see the module NOTE);
    with `split`, as `split_program` would find them in those instructions (no `wait-recv`
    is made, and a receive's consumer is known, not searched for), each rank's receives
    listed by sender (`_split_events`).

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
    t_start, t_end, topo = times.start, times.end, times.place
    opens, closes = ops.opens, ops.closes
    busy_starts, busy_ends = times.busy_starts, times.busy_ends
    final = rnd == cfg.accumulate - 1  # reductions run once per step, after the last round
    names, ats, placement, stages, tags = ops.names, ops.ats, cfg.placement, cfg.stages, ops.tags
    send, irecv = builder(Send), builder(IRecv)

    # NOTE (one rank at a time): a rank's instructions are its events in sorted order, and
    # sorting every rank's events together, as this once did, orders each rank's alike (the
    # keys are unique). So the receives each rank posts are found first (with the waits of
    # their consumers), and each rank's own events are then made, sorted and emitted before
    # the next rank's: a large lowering holds one rank's events at a time, not every rank's.
    #
    # NOTE (locality): a receive is found while lowering its sender but built while emitting
    # its receiver (`_Recv` until then; with `split`, once every rank's are emitted, a rank
    # at a time), so each rank's instructions are made together and lie together in memory:
    # the proof and the writer walk a program at a time, and at p = 64 (1.3 M instructions,
    # past the caches) a receiver's instructions scattered among every other rank's made the
    # proof about a fifth slower.
    incoming: list[list[tuple[Any, ...]]] = [[] for _ in range(cfg.ranks)]
    waits: dict[int, list[_Recv]] = {}  # by the number of the op they go before
    first = 0  # the number of the rank's first op
    for rank, prog in enumerate(schedule.programs if not split else ()):
        for pos, op in enumerate(prog):
            i = first + pos
            if closes[i] or op.kind == "R":
                continue
            pair = opens[i]  # (1: the op and the next are a pair, lowered as one unit)
            end = t_end[i + pair]
            for k in range(1 + pair):
                o = prog[pos + k]
                for tensor, dst in outputs_of(o, stages):
                    peer = placement[dst]
                    if peer == rank:
                        continue
                    consumer = ops.consumer(tensor, dst, o.mb)
                    mb = o.mb + offset if offset else o.mb  # (the op's own int where it can)
                    recv = [tensor, o.stage, mb, rank, tags[tag_of(tensor, o.stage, mb, stages)],
                            names[consumer], ats[consumer]]
                    post = _in_progress(busy_starts[peer], busy_ends[peer], end)
                    incoming[peer].append((post, -1, end, rank, pos, k, dst, None, None, recv))
                    waits.setdefault(consumer - closes[consumer], []).append(recv)
        first += len(prog)

    out: list[list[Instr] | Split] = []
    # (with `split`: per op number, where its compute starts in its rank's `rest`)
    start_of = array("q", bytes(8 * len(ops.names))) if split else array("q")
    received: list[list[tuple[Any, ...]]] = [[] for _ in range(cfg.ranks)] if split else []
    first = 0
    for rank, prog in enumerate(schedule.programs):
        # Each event is its sort key followed by: the number of the op whose receives are
        # waited for first (or None), where in its instructions each op of the (pair of)
        # ops takes its input (or None), and its instruction, its instructions, or the
        # receive it posts (`_Recv`, built here). NOTE: flat, not (key, payload): no two keys
        # are equal over their common length (they differ by time, then posts first, then by
        # the op's topological place, then compute before its sends, then by consumer), so
        # the sort never compares a payload, and a large lowering holds a tuple less per
        # event.
        events = incoming[rank]
        incoming[rank] = []
        for pos, op in enumerate(prog):
            i = first + pos
            if closes[i]:
                continue  # lowered with the first op of its pair
            if op.kind == "R":
                if final:
                    name, at = names[i], ats[i]
                    events.append((t_start[i], 0, topo[i], 0, rank, pos, None, None,
                                   ReduceGrad(op.stage, op=name, at=at)))
                continue
            pair = opens[i]
            start, end, at_place = t_start[i], t_end[i + pair], topo[i]
            body: list[Instr] = []
            after: list[Instr] = []
            consumes = 0  # (where in `body` each op of the pair takes its input: 4 bits each)
            for k in range(1 + pair):
                o = prog[pos + k]
                oo = names[i + k], ats[i + k]
                s, mb = o.stage, o.mb + offset if offset else o.mb
                consumes |= len(body) << 4 * k
                body += compute_instrs(o, mb, last, scale, oo)
                for tensor, dst in outputs_of(o, stages):
                    peer = placement[dst]
                    if peer == rank:
                        after.append(Handoff(tensor, s, mb, op=oo[0], at=oo[1]))
                        continue
                    tag = tags[tag_of(tensor, s, mb, stages)]
                    # (with `split`, the receive rides on its send: `_split_events`)
                    carried = (tensor, s, mb, rank, tag, ops.consumer(tensor, dst, o.mb)) \
                        if split else None
                    events.append((end, 0, at_place, 1, rank, pos, k, dst, None, carried,
                                   send(tensor, s, mb, peer, tag, oo[0], oo[1], False)))
            if pair:  # nothing may come between a pair's instructions
                body = body[:1] + [replace(b, paired=True) for b in body[1:]]
            events.append((start, 0, at_place, 0, rank, pos, i, consumes, body))
            if after:
                events.append((end, 0, at_place, 1, rank, pos, -1, None, None, after))
        events.sort()
        mine: list[Instr] = []
        if split:
            _split_events(events, mine, start_of, received)
            out.append(Split(mine, [], []))
            first += len(prog)
            continue
        for e in events:
            computed, instrs = e[-3], e[-1]
            if computed is not None:  # compute: its waits first (in the order their sends
                for tensor, s, mb, src, tag, name, at in waits.pop(computed, ()):  # happen)
                    mine.append(WaitRecv(tensor, s, mb, src, tag, op=name, at=at))
            if type(instrs) is list:
                if type(instrs[0]) is str:  # (a receive: `recv`)
                    tensor, s, mb, src, tag, name, at = instrs
                    mine.append(IRecv(tensor, s, mb, src, tag, op=name, at=at))
                else:
                    mine.extend(instrs)
            else:
                mine.append(instrs)
        del events
        out.append(mine)
        first += len(prog)
    if split:  # each rank's receives, as its senders sent them (`_split_events`)
        for rank, got in enumerate(received):
            received[rank] = []
            made = out[rank]
            assert isinstance(made, Split)
            made.recvs.extend(irecv(tensor, s, mb, src, tag, names[c], ats[c], False)
                              for tensor, s, mb, src, tag, c in got)
            made.needs.extend(start_of[c] for *_, c in got)
    return out


def _split_events(events: list[tuple[Any, ...]], rest: list[Instr], start_of: array[int],
                  received: list[list[tuple[Any, ...]]]) -> None:
    """`_lower_round`'s emission of one rank's sorted events with `split`: `rest` gets its
    instructions, `start_of` the place in `rest` of each op's first compute instruction (where
    it consumes its input), and each send's receive joins its receiver's `received`.

    NOTE (no receive events): a split program has no receives in `rest`, and the pass it is
    for places them itself, so where lowering would post one does not matter; what does is
    each peer's order of them (per-peer FIFO), which is the order of their sends, and where
    each is consumed. So a receive is carried by its send, not timed and sorted on its own
    (a third of a large lowering's events), and its `needs` is looked up once every rank's
    compute has its place."""
    for e in events:
        computed, instrs = e[-3], e[-1]
        if computed is not None:  # a compute: where the op (and a pair's second) consumes
            consumes = e[-2]
            start_of[computed] = len(rest) + (consumes & 15)
            if consumes:
                start_of[computed + 1] = len(rest) + (consumes >> 4 & 15)
            rest.extend(instrs)
        elif type(instrs) is list:
            rest.extend(instrs)
        else:
            rest.append(instrs)
            if e[-2] is not None:  # a send, with its receive
                received[instrs.peer].append(e[-2])  # type: ignore[attr-defined]


def compute_instrs(op: Op, mb: int, last: int, scale: float, o: tuple[str, str]) -> list[Instr]:
    """The compute instructions of one op; `o` is its origin (name, `.sched` line)."""
    s = op.stage
    name, at = o
    if op.kind == "F" or op.kind == "FC":
        body: list[Instr] = [Load(mb, "input", op=name, at=at)] if s == 0 else []
        body.append((Forward if op.kind == "F" else ForwardCheckpoint)(s, mb, op=name, at=at))
        if s == last:
            body += [Load(mb, "target", op=name, at=at), Loss(s, mb, scale, op=name, at=at)]
        return body
    if op.kind == "B":
        return [Backward(s, mb, op=name, at=at)]
    if op.kind == "I":
        return [BackwardInput(s, mb, op=name, at=at)]
    if op.kind == "RC":
        return [Recompute(s, mb, op=name, at=at)]
    if op.kind == "OFF":
        return [Offload(s, mb, op=name, at=at)]
    if op.kind == "RELOAD":
        return [Reload(s, mb, op=name, at=at)]
    return [BackwardWeight(s, mb, op=name, at=at)]


def outputs_of(op: Op, stages: int) -> list[tuple[Tensor, int]]:
    """The tensors `op` produces for another stage: (kind, consuming stage)."""
    if (op.kind == "F" or op.kind == "FC") and op.stage + 1 < stages:
        return [("act", op.stage + 1)]
    if op.kind in ("B", "I") and op.stage > 0:
        return [("grad", op.stage - 1)]
    return []
