"""Static verification of a schedule: ranges, placement, completeness, gradient reductions,
deadlock, memory.

`verify(schedule)` raises `VerifyError` (its `check` names what failed) or returns a
`VerifyReport` with the peak in-flight activations per rank. Checks run in that order and stop
at the first failing kind, since later checks presuppose earlier ones (a deadlock proof needs
every op present, a memory count needs every op's partner).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from pipeir._gc import paused_gc
from pipeir.diagnostics import Diagnostic, Note, Span, UsageError, VerifyError
from pipeir.limits import plain_number
from pipeir.memmodel import WHOLE, StageMemory, live_memory
from pipeir.memunit import COUNTING
from pipeir.ops import MEMORY_KINDS, NO_MB, REDUCE, Op
from pipeir.schedule import Schedule, expect_schedule

MAX_LISTED = 8  # diagnostics listed per failing check before "... and N more"

#: The relative slack of every comparison of memory against a limit: sums of byte sizes in
#: floating point are not exact (about 1e-11 relative after 65k ops), and a budget in bytes
#: one byte below what a schedule holds must still fail it (1e-9 let 999999999 B pass 1e9).
MEMORY_SLACK = 1e-10


def fits_in(held: float, limit: float) -> bool:
    """Whether `held` (bytes, or activations) is within `limit`: `check` and `synth` agree."""
    return held <= limit * (1 + MEMORY_SLACK)


def show_bytes(x: float) -> str:
    """Bytes in full (4,000,000,000): a limit and a peak that differ by one byte must print
    differently (`%.4g` wrote both as 4e+09)."""
    return f"{x:,.0f}" if float(x).is_integer() else f"{x:,.3f}"


class MemorySizes(Protocol):
    """What a memory count needs per stage (a `pipeir.sim.CostModel` is one): its memory in
    bytes and counted (`pipeir.memmodel`)."""

    def stage_memory(self, stage: int) -> StageMemory: ...

    def counted_memory(self, stage: int) -> StageMemory: ...


@dataclass(frozen=True)
class VerifyReport:
    """What verification learned: peak in-flight activations per rank and where each peaks,
    and the peak in bytes when verification was given the sizes."""

    peak_activations: tuple[float, ...]  # counted (an int where whole)
    peak_at: tuple[Op | None, ...]
    peak_bytes: tuple[float, ...] | None = None


def verify(schedule: Schedule, memory_limit: float | None = None,
           sizes: MemorySizes | None = None, memory_limit_bytes: float | None = None
           ) -> VerifyReport:
    """Check `schedule`; raise VerifyError on the first failing kind of check.

    `memory_limit` (activations, `pipeir.memunit`) overrides the pipeline's own
    `memory_limit` when given. With `sizes` (a cost model) activations are counted with its
    split (what W keeps after I), the report has the peak bytes per rank, and
    `memory_limit_bytes` bounds them.
    """
    expect_schedule(schedule, "verify")
    memory_limit, memory_limit_bytes = plain_number(memory_limit), plain_number(memory_limit_bytes)
    if sizes is not None and not callable(getattr(sizes, "counted_memory", None)):
        raise TypeError(f"verify(sizes=...): expected a CostModel (its activation sizes), got "
                        f"{type(sizes).__name__}")
    if memory_limit_bytes is not None:
        if type(memory_limit_bytes) not in (int, float) or \
                not 0 < memory_limit_bytes < math.inf:
            raise UsageError(f"memory_limit_bytes must be a positive number of bytes, got "
                             f"{memory_limit_bytes!r}")
        if sizes is None or getattr(sizes, "knows_memory", True) is False:
            # (without memory_bytes every peak is 0 bytes: any limit would hold)
            raise UsageError("memory_limit_bytes needs the activation sizes: a cost model "
                             "with memory_bytes (sizes=CostModel(memory_bytes=...))")
    if memory_limit is not None and (isinstance(memory_limit, bool) or
                                     not isinstance(memory_limit, int | float) or
                                     not 0 < memory_limit < math.inf):
        raise UsageError(f"memory_limit must be a positive number of activations, got "
                         f"{memory_limit!r}")
    try:
        return _verify(schedule, memory_limit, sizes, memory_limit_bytes)
    except VerifyError as e:
        d = e.diagnostics[0]
        if schedule.used_as is not None:
            name, used = schedule.used_as
            if d.span is None or d.span.source is not used.source:
                e.annotate(Note(f"in library schedule '{name}', used here", used))
        raise


def _verify(schedule: Schedule, memory_limit: float | None, sizes: MemorySizes | None,
            memory_limit_bytes: float | None) -> VerifyReport:
    with paused_gc():
        _raise("range", check_ranges(schedule))
        _raise("placement", check_placement(schedule))
        _raise("completeness", check_completeness(schedule))
        _raise("reduction", check_reductions(schedule))
        _raise("overlap", check_pairs(schedule))
        _raise("deadlock", check_deadlock(schedule))
        report = memory_report(schedule, sizes)
        limit = memory_limit if memory_limit is not None else schedule.config.memory_limit
        _raise("memory", check_memory(schedule, report, limit, sizes))
        if sizes is not None:
            report = VerifyReport(report.peak_activations, report.peak_at,
                                  peak_bytes(schedule, sizes.stage_memory))
            if memory_limit_bytes is not None:
                _raise("memory", check_memory_bytes(schedule, sizes.stage_memory,
                                                    memory_limit_bytes))
    return report


def _raise(check: str, diags: list[Diagnostic]) -> None:
    if diags:
        if len(diags) > MAX_LISTED:
            rest = len(diags) - MAX_LISTED
            diags = [*diags[:MAX_LISTED], Diagnostic(f"... and {rest} more like these")]
        raise VerifyError(diags, check)


def check_ranges(schedule: Schedule) -> list[Diagnostic]:
    """Every op's stage and micro-batch is in range."""
    c = schedule.config
    out = []
    for op in schedule:
        why = c.out_of_range(op.stage, None if op.kind == REDUCE else op.mb)
        if why is not None:
            out.append(Diagnostic(f"{op}: {why}", schedule.span_of(op)))
    return out


def check_placement(schedule: Schedule) -> list[Diagnostic]:
    """Every op runs on the rank that owns its stage."""
    c = schedule.config
    out = []
    for r, prog in enumerate(schedule.programs):
        for op in prog:
            why = c.misplaced(r, op.stage)
            if why is not None:
                out.append(Diagnostic(f"{op} runs on rank {r}, but {why}", schedule.span_of(op)))
    return out


def check_completeness(schedule: Schedule) -> list[Diagnostic]:
    """Each (stage, micro-batch) has one forward (F, or a checkpointed FC with its RC) and
    either one B or one I and one W; an OFF comes with its RELOAD, after an F.

    NOTE: asked of every (stage, micro-batch), so it looks ops up as plain (kind, stage, mb)
    tuples in one set: building ten `Op`s per pair and asking the graph made it half of
    `verify` (1.9 s of 3.0 at p = 32, v = 4, m = 256)."""
    c = schedule.config
    have: set[tuple[str, int, int]] = {(op.kind, op.stage, op.mb) for op in schedule}
    memory_ops = any(k in MEMORY_KINDS for k, _, _ in have)
    out = []
    for s in range(c.stages):
        for m in range(c.microbatches):
            missing = []
            has_f, has_fc = ("F", s, m) in have, ("FC", s, m) in have
            if has_f and has_fc:
                fc = Op("FC", s, m)
                out.append(Diagnostic(f"stage {s}, micro-batch {m} has both {Op('F', s, m)} and "
                                      f"{fc}: a forward either keeps its activations or not",
                                      schedule.span_of(fc)))
            elif not has_f and not has_fc:
                missing.append(Op("F", s, m))
            has_b, has_i, has_w = ("B", s, m) in have, ("I", s, m) in have, ("W", s, m) in have
            if has_b and (has_i or has_w):
                other = Op("I", s, m) if has_i else Op("W", s, m)
                out.append(Diagnostic(
                    f"stage {s}, micro-batch {m} has both {Op('B', s, m)} and {other}: "
                    "a backward is either B or the pair I + W", schedule.span_of(other)))
                continue
            if not has_b:
                if not has_i and not has_w:
                    missing.append(Op("B", s, m))
                elif not has_i:
                    missing.append(Op("I", s, m))
                elif not has_w:
                    missing.append(Op("W", s, m))
            if missing:
                rank = c.placement[s]
                out.append(Diagnostic(
                    f"missing {' and '.join(map(str, missing))}: the schedule never runs "
                    f"{'them' if len(missing) > 1 else 'it'} (stage {s} lives on rank {rank})",
                    _program_span(schedule, rank)))
            if memory_ops:
                out.extend(_memory_op_pairs(schedule, have, s, m))
    return out


def _memory_op_pairs(schedule: Schedule, have: set[tuple[str, int, int]], s: int, m: int
                     ) -> list[Diagnostic]:
    """FC comes with RC (not on the last stage, whose forward feeds the loss), OFF with
    RELOAD, and OFF only after an F (an FC keeps nothing to offload). `have`: the schedule's
    ops as (kind, stage, mb)."""
    f, fc, rc = Op("F", s, m), Op("FC", s, m), Op("RC", s, m)
    off, rel = Op("OFF", s, m), Op("RELOAD", s, m)

    def has(op: Op) -> bool:
        return (op.kind, op.stage, op.mb) in have

    out = []
    if has(fc) and s == schedule.config.stages - 1:
        out.append(Diagnostic(f"{fc}: the last stage's forward feeds the loss and cannot be "
                              f"checkpointed; write {f}", schedule.span_of(fc)))
    if has(fc) and not has(rc):
        out.append(Diagnostic(f"{fc} keeps only its input, but the schedule never runs {rc} "
                              "to recompute it before the backward", schedule.span_of(fc)))
    if has(rc) and not has(fc):
        out.append(Diagnostic(f"{rc} recomputes a checkpointed forward, but stage {s}, "
                              f"micro-batch {m} has no {fc}"
                              + (f" ({f} keeps its activations)" if has(f) else ""),
                              schedule.span_of(rc)))
    if has(off) and not has(f):
        out.append(Diagnostic(f"{off} offloads the activations {f} keeps, but the schedule "
                              f"has no {f}", schedule.span_of(off)))
    if has(off) and not has(rel):
        out.append(Diagnostic(f"{off} moves activations to host memory, but the schedule never "
                              f"runs {rel} to bring them back for the backward",
                              schedule.span_of(off)))
    if has(rel) and not has(off):
        out.append(Diagnostic(f"{rel} brings back activations that no {off} offloaded",
                              schedule.span_of(rel)))
    return out


def check_reductions(schedule: Schedule) -> list[Diagnostic]:
    """Gradient reductions (data parallelism): none, or one R(s) per stage (a duplicate is
    already an error when building); each after every weight gradient of its stage on its
    rank (B or W of each micro-batch), and not half of an overlapped pair. The optimizer step
    closes every rank's program, so an R always precedes it (lowering waits for it there)."""
    c = schedule.config
    reduced = [s for s in range(c.stages) if Op(REDUCE, s, NO_MB) in schedule]
    if not reduced:
        return []
    out = []
    missing = [s for s in range(c.stages) if s not in reduced]
    if missing:
        s = missing[0]
        first = Op(REDUCE, reduced[0], NO_MB)
        out.append(Diagnostic(
            f"stage {s} never reduces its gradients (no {Op(REDUCE, s, NO_MB)}) while "
            f"{first} does: with data parallelism every stage needs one reduction "
            f"(missing for stage{'s' if len(missing) > 1 else ''} "
            f"{', '.join(map(str, missing))}; the pass dp-reduce places them all)",
            _program_span(schedule, c.placement[s]),
            (Note(f"{first} is here", schedule.span_of(first)),)
            if schedule.span_of(first) is not None else ()))
    for s in reduced:
        r = Op(REDUCE, s, NO_MB)
        pos = schedule.position_of(r)
        if schedule.pair_of(r) is not None:
            out.append(Diagnostic(f"{r} is half of an overlapped pair: a reduction runs on "
                                  "its own channel and cannot be paired", schedule.span_of(r)))
        later = [op for op in schedule.program(schedule.rank_of(r))[pos + 1:]
                 if op.stage == s and op.kind in ("B", "W")]
        if later:
            out.append(Diagnostic(
                f"{r} comes before {later[0]} on rank {schedule.rank_of(r)}: a reduction "
                "must follow every weight gradient (B or W) of its stage", schedule.span_of(r),
                (Note(f"{later[0]} is here", schedule.span_of(later[0])),)
                if schedule.span_of(later[0]) is not None else ()))
    return out


def check_pairs(schedule: Schedule) -> list[Diagnostic]:
    """The two ops of an overlapped pair must not depend on each other: they run together."""
    if not schedule.pairs:
        return []
    deps = schedule.deps
    out = []
    for a, b in schedule.pairs:
        for x, y in ((a, b), (b, a)):
            if deps.index[x] in deps.data_preds[deps.index[y]]:
                out.append(Diagnostic(f"overlap pair {a} + {b}: {y} needs {x}'s result, so "
                                      "they cannot run together", schedule.span_of(a)))
    return out


def _program_span(schedule: Schedule, rank: int) -> Span | None:
    for op in schedule.program(rank):
        span = schedule.span_of(op)
        if span is not None:
            return span
    return schedule.span


def check_deadlock(schedule: Schedule) -> list[Diagnostic]:
    """The union of data and program-order edges (and the waits of overlapped pairs) is
    acyclic, i.e. every rank can run its program to the end. On failure, explain one waiting
    cycle across ranks."""
    deps = schedule.deps
    if deps.acyclic:
        return []
    return [_explain_deadlock(schedule, {deps.ops[i] for i in deps.blocked()})]


def _explain_deadlock(schedule: Schedule, stuck: set[Op]) -> Diagnostic:
    """Follow who-waits-for-whom from a blocked rank until a rank repeats."""
    heads: dict[int, Op] = {}
    for r, prog in enumerate(schedule.programs):
        for op in prog:
            if op in stuck:
                heads[r] = op
                break

    deps = schedule.deps
    ops = deps.ops
    partner_needs: dict[Op, list[tuple[Op, Op]]] = {}
    for p, first, second in deps.pair_waits:
        partner_needs.setdefault(ops[first], []).append((ops[p], ops[second]))

    def waits_for(op: Op) -> Op:
        for j in deps.data_preds[deps.index[op]]:
            if ops[j] in stuck:
                return ops[j]
        for p, _ in partner_needs.get(op, ()):
            if p in stuck:
                return p
        raise AssertionError(f"{op} is blocked but waits for nothing")  # pragma: no cover

    def where(op: Op) -> str:
        span = schedule.span_of(op)
        pair = schedule.pair_of(op)
        together = f", overlapped with {pair}" if pair is not None else ""
        return f" (line {span.line}{together})" if span is not None else \
            (f" (overlapped with {pair})" if pair is not None else "")

    rank = min(heads)
    chain: list[tuple[int, Op, Op]] = []  # (rank, its blocked head, the op it waits for)
    seen: dict[int, int] = {}
    while rank not in seen:
        seen[rank] = len(chain)
        head = heads[rank]
        need = waits_for(head)
        chain.append((rank, head, need))
        need_rank = schedule.rank_of(need)
        if need_rank == rank:
            break
        rank = need_rank
    if chain[-1][0] == schedule.rank_of(chain[-1][2]):  # a rank waits on itself
        r, head, need = chain[-1]
        return Diagnostic(
            f"deadlock: rank {r} runs {head}{where(head)} before {need}{where(need)}, "
            f"which {head} needs",
            schedule.span_of(head), (Note(f"{need} comes later in rank {r}'s program",
                                          schedule.span_of(need)),))
    cycle = chain[seen[rank]:]
    parts = []
    for i, (r, head, need) in enumerate(cycle):
        nr = schedule.rank_of(need)
        nxt_head = cycle[(i + 1) % len(cycle)][1]
        then = "which is itself waiting there" if need == nxt_head else \
            f"which comes after {nxt_head} there"
        parts.append(f"rank {r} waits at {head}{where(head)} for {need} on rank {nr}, {then}")
    notes = tuple(Note(f"rank {r} is stuck here, at {head}", schedule.span_of(head))
                  for r, head, _ in cycle)
    return Diagnostic("deadlock: " + "; ".join(parts), schedule.span_of(cycle[0][1]), notes)


def live_activations(program: Iterable[Op], size: Callable[[Op], float] | None = None,
                     input_size: Callable[[Op], float] | None = None
                     ) -> Iterator[tuple[Op, float]]:
    """(op, activations in flight after it) along a rank's program, each activation held
    whole until its last backward (B, or W): `pipeir.memmodel`'s rule with no split known.
    `size` (per op: its stage's saved activations) defaults to one unit per (stage,
    micro-batch) and `input_size` (what an FC keeps) to none, so the unit count is the peers'
    "micro-batches in flight". With a cost model's split, ask `live_memory` instead."""
    if size is None and input_size is None:
        return live_memory(program, lambda op: WHOLE)
    table: dict[int, StageMemory] = {}  # (sizes are per stage: built once each)

    def memory(op: Op) -> StageMemory:
        got = table.get(op.stage)
        if got is None:
            saved = 1.0 if size is None else size(op)
            got = table[op.stage] = StageMemory(saved, saved,
                                                0.0 if input_size is None else input_size(op))
        return got
    return live_memory(program, memory)


def memory_report(schedule: Schedule, sizes: MemorySizes | None = None) -> VerifyReport:
    """Peak in-flight activations per rank, counted (`pipeir.memunit`) with the split of
    `sizes` (a cost model's `counted_memory`; without: held whole until W). Depends only on
    program order, not on timing."""
    counted = _per_stage(schedule, None if sizes is None else sizes.counted_memory)
    peaks: list[float] = []
    at: list[Op | None] = []
    for prog in schedule.programs:
        peak = 0.0
        peak_op: Op | None = None
        for op, live in live_memory(prog, counted):
            if live > peak + MEMORY_SLACK:
                peak, peak_op = live, op
        peaks.append(_count(peak))
        at.append(peak_op)
    return VerifyReport(tuple(peaks), tuple(at))


def _count(x: float) -> float:
    """A counted peak as reports show it: an int when whole (sums of fractions are rounded
    first, 2.9999999999 being 3)."""
    x = round(x, 9)
    return int(x) if x.is_integer() else x


def _per_stage(schedule: Schedule, memory: Callable[[int], StageMemory] | None
               ) -> Callable[[Op], StageMemory]:
    """Each op's stage memory from `memory` (None: one counted activation, held whole),
    asked once per stage."""
    if memory is None:
        return lambda op: WHOLE
    table = {s: memory(s) for s in range(schedule.config.stages)}
    return lambda op: table[op.stage] if op.stage in table else memory(op.stage)


def peak_bytes(schedule: Schedule, memory: Callable[[int], StageMemory]) -> tuple[float, ...]:
    """Per rank, the most bytes of saved activations held at once (`live_memory` with each
    stage's `memory`: a cost model's `stage_memory`)."""
    per_op = _per_stage(schedule, memory)
    return tuple(max((live for _, live in live_memory(prog, per_op)), default=0.0)
                 for prog in schedule.programs)


def check_memory_bytes(schedule: Schedule, memory: Callable[[int], StageMemory],
                       limit: float) -> list[Diagnostic]:
    """No rank holds more than `limit` bytes of saved activations (see `peak_bytes`)."""
    per_op = _per_stage(schedule, memory)
    out = []
    for r, prog in enumerate(schedule.programs):
        lives = list(live_memory(prog, per_op))
        over = next(((op, live) for op, live in lives if not fits_in(live, limit)), None)
        if over is not None:
            peak = max(live for _, live in lives)
            out.append(Diagnostic(
                f"memory limit exceeded on rank {r}: {over[0]} makes {show_bytes(over[1])} "
                f"bytes of activations (memory_limit = {show_bytes(limit)} bytes; this rank "
                f"peaks at {show_bytes(peak)})", schedule.span_of(over[0])))
    return out


def check_memory(schedule: Schedule, report: VerifyReport, limit: float | None,
                 sizes: MemorySizes | None = None) -> list[Diagnostic]:
    """No rank holds more than `limit` in-flight activations at once (counted as `report`
    was, with the split of `sizes`)."""
    if limit is None:
        return []
    counted = _per_stage(schedule, None if sizes is None else sizes.counted_memory)
    out = []
    for r, prog in enumerate(schedule.programs):
        peak = report.peak_activations[r]
        if fits_in(peak, limit):
            continue
        op, live = next((op, live) for op, live in live_memory(prog, counted)
                        if not fits_in(live, limit))
        out.append(Diagnostic(
            f"memory limit exceeded on rank {r}: {op} makes {_count(live):g} activations in "
            f"flight (memory_limit = {limit:g}, counting {COUNTING}; this rank peaks at "
            f"{peak:g})", schedule.span_of(op)))
    return out
