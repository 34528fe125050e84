"""interleave: the virtual pipeline (Megatron-LM's interleaved 1F1B) as a transformation.

Each rank's one stage is cut into `v` chunks, giving p·v virtual stages placed in a loop (or a
V), and every rank walks its chunks depth-first: forwards go chunk 0, 1, ..., v-1 for a round
of micro-batches, backwards the other way round. The order is derived from the input's shape,
which is why the pass accepts exactly the schedules that have one (see `_shape`):

    rank r:  F x w[r],  (F B) x (m - w[r]),  B x w[r]      micro-batches in order

1F1B (w[r] = min(p-1-r, m)) and GPipe (w[r] = m) are such schedules. The interleaved rank r
runs `(v-1)·R + 2·w[r]` forwards before its first backward (R micro-batches per round; the
factor 2 is the round trip to the last rank and back), then F/B pairs, then the remaining
backwards; a rank that ran all its forwards first (w[r] = m) still does. For 1F1B this is
exactly Megatron's and torch's `ScheduleInterleaved1F1B` order, i.e. the library's
`interleaved-1f1b`.

NOTE: micro-batches enter in rounds of R = m / max(1, m // p), so m must be a multiple of
the number of rounds (torch's rule; any m <= p and any multiple of p work).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import ClassVar, Literal

from pipeir.config import ConfigError, PipelineConfig
from pipeir.diagnostics import Note, Span, UsageError
from pipeir.ops import Op
from pipeir.passes.base import OptionError, Pass
from pipeir.passes.context import DEFAULT_CONTEXT, PassContext
from pipeir.passes.dp_reduce import reject_reductions
from pipeir.passes.memory import reject_memory_ops
from pipeir.schedule import Schedule
from pipeir.sim.engine import Timing
from pipeir.verify import live_activations, memory_report

Placement = Literal["loop", "vshape"]


@dataclass(frozen=True)
class Interleave(Pass):
    """Split each rank's stage into `v` chunks and run them in depth-first order."""

    name: ClassVar[str] = "interleave"
    summary: ClassVar[str] = ("virtual pipeline: v chunks per rank in Megatron's depth-first "
                              "order (1F1B becomes interleaved 1F1B)")

    v: int = 2
    placement: Placement = "loop"

    def __post_init__(self) -> None:
        if isinstance(self.v, bool) or not isinstance(self.v, int) or self.v < 1:
            raise OptionError("v", f"interleave: v (chunks per rank) must be a positive "
                                   f"integer, got {self.v!r}")
        if self.placement not in ("loop", "vshape"):
            raise OptionError("placement", f"interleave: placement must be loop or vshape, "
                                           f"got {self.placement!r}")

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        reject_memory_ops(schedule, self.name)
        c = schedule.config
        reject_reductions(schedule, self.name)
        warmups = _shape(schedule)
        rounds = max(1, c.microbatches // c.ranks)
        if c.microbatches % rounds:
            raise UsageError(
                f"interleave: {c.microbatches} micro-batches on {c.ranks} ranks enter in "
                f"max(1, m // p) = {rounds} rounds, and {c.microbatches} is not a multiple "
                f"of {rounds}", None,
                (Note(f"m = {' or '.join(map(str, _admissible_near(c.microbatches, c.ranks)))}"
                      f" would work (any m <= {c.ranks}, or a multiple of the rounds)"),))
        if self.v == 1:
            return schedule  # one chunk per rank (a V of one chunk is the loop): plain 1F1B
        try:
            config = PipelineConfig.make(
                c.ranks, c.microbatches, c.ranks * self.v, self.placement,
                None if c.memory_limit is None else c.memory_limit * self.v, c.accumulate)
        except ConfigError as e:  # pragma: no cover - the inputs above are always valid
            raise UsageError(f"interleave: {e}") from None
        per_round = c.microbatches // rounds
        total = c.microbatches * self.v
        warm = [total if w == c.microbatches else min((self.v - 1) * per_round + 2 * w, total)
                for w in warmups]
        if self.placement == "vshape" and any(w < total for w in warm):
            # Megatron's order is for a loop; on a V, the list order (`_v_order`) within the
            # loop order's peak
            looped = PipelineConfig.make(c.ranks, c.microbatches, config.stages)
            cap = max(max((live for _, live in live_activations(
                self._program(looped, r, warm[r], per_round))), default=0)
                for r in range(c.ranks))
            programs = _v_order(config, cap)
            if programs is not None:
                return self._checked(Schedule.from_programs(
                    config, programs, schedule.name, _spans(schedule, programs)), c.memory_limit)
        return self._checked(self._depth_first(schedule, config, warm, per_round, ctx),
                             c.memory_limit)

    def _depth_first(self, schedule: Schedule, config: PipelineConfig, warm: list[int],
                     per_round: int, ctx: PassContext) -> Schedule:
        """Megatron's order (`_program`), each warm-up lengthened until the order runs."""
        while True:
            programs = [self._program(config, r, warm[r], per_round) for r in range(config.ranks)]
            out = Schedule.from_programs(config, programs, schedule.name,
                                         _spans(schedule, programs))
            heads = Timing(out, ctx.costs).stuck()
            stuck = [r for r, k in enumerate(heads) if k is not None and programs[r][k].kind == "B"]
            if not stuck:
                break
            # NOTE: Megatron's warm-up counts the round trip through a loop placement; in a V
            # the chunks meet on the same rank and a rank can need more forwards before its
            # first backward is ready. Lengthen the warm-up of each rank that waits at a
            # backward until the order runs; all-forwards-first always does, so this ends.
            for r in stuck:
                warm[r] += 1
        return out

    def _checked(self, out: Schedule, limit: int | None) -> Schedule:
        """`out`, if its peak is within the input's `limit` x v (chunk activations)."""
        if limit is not None:
            peaks = memory_report(out).peak_activations
            worst = max(range(len(peaks)), key=peaks.__getitem__)
            if peaks[worst] > limit * self.v:
                raise UsageError(
                    f"interleave{{v={self.v}}}: the interleaved order holds {peaks[worst]} "
                    f"chunk activations on rank {worst}, more than memory_limit x v = "
                    f"{limit} x {self.v} = {limit * self.v}", None,
                    (Note(f"raise memory_limit to {-(-peaks[worst] // self.v)} or use a "
                          "smaller v"),))
        return out

    def _program(self, config: PipelineConfig, r: int, warm: int, per_round: int) -> list[Op]:
        """Rank r's depth-first order: `warm` forwards, F/B pairs, the remaining backwards."""
        local, v = config.stages_of(r), self.v
        total = config.microbatches * v

        def mb(k: int) -> int:
            return (k // (per_round * v)) * per_round + k % per_round

        fwd = [Op("F", local[(k // per_round) % v], mb(k)) for k in range(total)]
        bwd = [Op("B", local[v - 1 - (k // per_round) % v], mb(k)) for k in range(total)]
        prog = fwd[:warm]
        for k in range(total - warm):
            prog += [fwd[warm + k], bwd[k]]
        return prog + bwd[total - warm:]


def _spans(schedule: Schedule, programs: list[list[Op]]) -> dict[Op, Span | None]:
    """Each chunk's op points at the rank's op it comes from."""
    return {op: schedule.span_of(Op(op.kind, r, op.mb))
            for r, prog in enumerate(programs) for op in prog}


def _v_order(config: PipelineConfig, cap: float) -> list[list[Op]] | None:
    """Every rank's order on a V placement: a list schedule in unit time (F = 1, B = 2, free
    links) in which a free rank runs its oldest ready backward, else, while it holds fewer
    than `cap` chunk activations, its deepest ready forward (oldest micro-batch first), else
    waits. The order is one execution's, so it never deadlocks whatever the costs.

    NOTE: Megatron's depth-first order assumes a loop, where a micro-batch's next chunk on a
    rank is p stages away; on a V a rank's two chunks of one micro-batch are 2(p - r) - 1
    stages apart, so rank 0 ran its forwards of chunk 0 and then waited the whole way down for
    chunk 1. Steps under chunk costs (F = 1/v, B = 2/v), depth-first -> this order (the loop;
    plain 1F1B): p = 4, m = 8, v = 2: 48 -> 32.5 (28.5; 33); p = 8, m = 32: 474 -> 115
    (106.5; 117); p = 4, m = 8, v = 4: 52.5 -> 30.5 (26.25; 33). It still trails the loop,
    and at p = 4, m = 16 plain 1F1B (61.5 against 57): unsplit backwards favour the loop, and
    the V is zero bubble's placement, with I and W (zb-v, dualpipe-v, or `synth`). The cap is
    the loop's peak on its busiest rank for every rank: a V's ranks hold alike (capped at the
    loop's per-rank peaks, 45 and 260). The depth-first order stays where this one stalls.
    Not `synth.greedy`, the memory-aware list scheduler synth starts from: it runs the
    context's costs over twelve variants, 60 s at p = 32, m = 128, v = 4 (0.7 s here), and
    its deterministic variants lost to plain 1F1B at p = 8, m = 32 (118.5 against 117)."""
    stages, m = config.stages, config.microbatches
    ends: dict[Op, int] = {}
    programs: list[list[Op]] = [[] for _ in range(config.ranks)]
    free, live = [0] * config.ranks, [0] * config.ranks
    next_f, next_b = [0] * stages, [0] * stages

    def ready(op: Op | None, t: int) -> bool:
        return op is None or ends.get(op, t + 1) <= t

    wake = [(0, r) for r in range(config.ranks)]
    left = 2 * stages * m
    while left:
        if not wake:
            return None  # every rank waits: the depth-first order stands
        t, r = heapq.heappop(wake)
        if free[r] > t:
            continue
        pick: tuple[tuple[int, int], Op] | None = None
        for s in config.stages_of(r):
            k = next_b[s]
            if k < m and ready(Op("F", s, k) if s == stages - 1 else Op("B", s + 1, k), t) \
                    and (pick is None or (k, -s) < pick[0]):
                pick = ((k, -s), Op("B", s, k))
        if pick is None and live[r] < cap:
            for s in config.stages_of(r):
                k = next_f[s]
                if k < m and ready(Op("F", s - 1, k) if s else None, t) \
                        and (pick is None or (-s, k) < pick[0]):
                    pick = ((-s, k), Op("F", s, k))
        if pick is None:
            continue  # woken again when an op it waits for ends
        op = pick[1]
        end = t + (1 if op.kind == "F" else 2)
        ends[op], free[r] = end, end
        programs[r].append(op)
        left -= 1
        if op.kind == "F":
            next_f[op.stage] += 1
            live[r] += 1
        else:
            next_b[op.stage] += 1
            live[r] -= 1
        heapq.heappush(wake, (end, r))
        after = op.stage + 1 if op.kind == "F" and op.stage < stages - 1 else \
            op.stage - 1 if op.kind == "B" else op.stage
        if 0 <= after < stages:
            heapq.heappush(wake, (end, config.placement[after]))
    return programs


def _shape(schedule: Schedule) -> list[int]:
    """Each rank's warm-up w[r], if the schedule is 1F1B-shaped; else say what is wrong."""
    c = schedule.config
    if c.stages != c.ranks or any(c.placement[s] != s for s in range(c.stages)):
        raise UsageError(
            f"interleave: the input must have one stage per rank, stage r on rank r (it has "
            f"{c.stages} stages on {c.ranks} ranks, placement {list(c.placement)}); interleave "
            "makes the virtual stages itself")
    m = c.microbatches
    warmups = []
    for r, prog in enumerate(schedule.programs):
        if any(op.kind in ("I", "W") for op in prog):
            raise UsageError("interleave: the input has split backwards (I and W); interleave "
                             "first, then split: 'interleave{v=2},split-backward'")
        lead = 0  # forwards before the first backward: w, plus the first pair's F
        while lead < len(prog) and prog[lead].kind == "F":
            lead += 1
        w = m if lead >= m else max(0, lead - 1)
        expected = ([Op("F", r, i) for i in range(w)]
                    + [op for i in range(m - w) for op in (Op("F", r, w + i), Op("B", r, i))]
                    + [Op("B", r, i) for i in range(m - w, m)])
        for i, (got, want) in enumerate(zip(prog, expected)):
            if got != want:
                raise _not_shaped(schedule, r, w, f"op {i + 1} is {got} where {want} was "
                                                  "expected", schedule.span_of(got))
        if len(prog) != len(expected):
            raise _not_shaped(schedule, r, w, f"it has {len(prog)} ops, expected {len(expected)}",
                              None)
        warmups.append(w)
    return warmups


def _not_shaped(schedule: Schedule, rank: int, w: int, why: str, span: Span | None
                ) -> UsageError:
    return UsageError(
        f"interleave: rank {rank}'s program is not 1F1B-shaped: {why}", span,
        (Note(f"interleave accepts, per rank, w forwards, then forward/backward pairs, then w "
              f"backwards, micro-batches in order (here w = {w}); 1F1B and GPipe have that "
              "shape"),))


def _admissible_near(m: int, p: int) -> list[int]:
    """The closest micro-batch counts below and above m that interleave admits."""

    def ok(n: int) -> bool:
        return n >= 1 and n % max(1, n // p) == 0

    below = next((n for n in range(m - 1, 0, -1) if ok(n)), None)
    above = next(n for n in range(m + 1, 2 * m + p + 2) if ok(n))
    return [n for n in (below, above) if n is not None]
