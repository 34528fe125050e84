"""Measured timelines: instruction timestamps of one step, shaped as a `SimResult`.

Shaping the measurement like a simulation lets `run` reuse the simulator's Chrome-trace writer
(so `run --trace` and `simulate --trace` can be laid side by side) and its bubble definition:
per rank, idle / makespan; overall, 1 - busy / (ranks x makespan). "Busy" is time inside
compute instructions (load, forward, loss, backward and its halves); communication, waits and
the optimizer step count as idle, as in the simulator.

With `accumulate = k` the step runs k rounds; `expand_rounds` builds the equivalent schedule
with k*m micro-batches so measured and predicted timelines cover the same work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from statistics import mean

from pipeir.backend.lower import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Batch,
    Forward,
    Instr,
    ISend,
    Load,
    Loss,
    Lowered,
    Recv,
    Send,
    WaitRecv,
)
from pipeir.config import PipelineConfig
from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.sim import CostModel, SimResult, Transfer, simulate

Times = Sequence[tuple[int, float, float]]  # (pc, start, end) per executed instruction


def expand_rounds(schedule: Schedule) -> Schedule:
    """The schedule run `accumulate` times back to back, as one schedule of k*m micro-batches."""
    c = schedule.config
    if c.accumulate == 1:
        return schedule
    progs = [[Op(op.kind, op.stage, op.mb + r * c.microbatches)
              for r in range(c.accumulate) for op in prog] for prog in schedule.programs]
    cfg = PipelineConfig(c.ranks, c.microbatches * c.accumulate, c.stages, c.placement)
    return Schedule.from_programs(cfg, progs, schedule.name)


def _op_of(ins: Instr, schedule: Schedule) -> Op | None:
    if isinstance(ins, (Forward, Loss)):
        return Op("F", ins.stage, ins.mb)
    if isinstance(ins, Load):
        return Op("F", 0 if ins.part == "input" else schedule.config.stages - 1, ins.mb)
    if isinstance(ins, Backward):
        return Op("B", ins.stage, ins.mb)
    if isinstance(ins, BackwardInput):
        return Op("I", ins.stage, ins.mb)
    if isinstance(ins, BackwardWeight):
        return Op("W", ins.stage, ins.mb)
    return None


def measured_result(lowered: Lowered, schedule: Schedule, times: Mapping[int, Times]
                    ) -> SimResult:
    """The measured step as a SimResult (seconds from the step's first compute instruction).
    `schedule` must be `expand_rounds` of the compiled schedule."""
    # NOTE: the step is timed from the first compute instruction to the last one, on any
    # rank: a rank that enters the step early only to block on a receive (its peers still
    # finishing the previous step) would otherwise stretch the step back in time.
    spans = [(t0, t1) for r in times for pc, t0, t1 in times[r]
             if _op_of(lowered.program(r)[pc], schedule) is not None]
    t_zero = min(t0 for t0, _ in spans)
    t_end = max(t1 for _, t1 in spans)
    start: dict[Op, float] = {}
    end: dict[Op, float] = {}
    busy = [0.0] * lowered.ranks
    sent: dict[tuple[str, int, int], tuple[int, float]] = {}
    arrived: dict[tuple[str, int, int], tuple[int, float]] = {}
    for r in range(lowered.ranks):
        prog = lowered.program(r)
        for pc, t0, t1 in times.get(r, ()):
            ins = prog[pc]
            op = _op_of(ins, schedule)
            if op is not None and op in schedule:
                busy[r] += t1 - t0
                start[op] = min(start.get(op, t0 - t_zero), t0 - t_zero)
                end[op] = max(end.get(op, 0.0), t1 - t_zero)
            for c in (ins.posts if isinstance(ins, Batch) else (ins,)):
                if isinstance(c, (Send, ISend)):
                    sent.setdefault(c.key, (r, t0 - t_zero))
                elif isinstance(c, (Recv, WaitRecv)):
                    arrived[c.key] = (r, t1 - t_zero)
    makespan = t_end - t_zero
    transfers = [_transfer(key, sent[key], arrived[key], schedule)
                 for key in sorted(sent) if key in arrived]
    return SimResult(schedule, CostModel(unit="s"), "measured", start, end, makespan,
                     tuple(busy), tuple(makespan - b for b in busy), tuple(0.0 for _ in busy),
                     tuple(0 for _ in busy), tuple(0.0 for _ in busy), None, [], transfers)


def _transfer(key: tuple[str, int, int], src: tuple[int, float], dst: tuple[int, float],
              schedule: Schedule) -> Transfer:
    tensor, stage, mb = key
    if tensor == "act":
        a, b = Op("F", stage, mb), Op("F", stage + 1, mb)
    else:
        a = Op("B", stage, mb) if Op("B", stage, mb) in schedule else Op("I", stage, mb)
        b = (Op("B", stage - 1, mb) if Op("B", stage - 1, mb) in schedule
             else Op("I", stage - 1, mb))
    return Transfer(a, b, src[0], dst[0], src[1], max(src[1], dst[1]), 0.0)


def calibrated_prediction(measured: SimResult) -> SimResult:
    """The simulator's prediction with op costs set to the measured mean time per kind
    (communication free), for the bubble printed beside the measured one."""
    by_kind: dict[str, list[float]] = {}
    for op, t0 in measured.start.items():
        by_kind.setdefault(op.kind, []).append(measured.end[op] - t0)
    kw = {k: mean(v) for k, v in by_kind.items()}
    if "B" not in kw and not ("I" in kw and "W" in kw):
        kw.setdefault("B", 2 * kw.get("F", 1.0))
    return simulate(measured.schedule, CostModel(unit="s", **kw))
