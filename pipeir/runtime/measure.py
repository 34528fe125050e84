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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import mean, median
from typing import Any

from pipeir import limits
from pipeir.backend.instructions import (
    COMPUTE,
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
    Offload,
    Recompute,
    Recv,
    ReduceGrad,
    Reload,
    Send,
    WaitRecv,
    WaitReduce,
)
from pipeir.config import PipelineConfig
from pipeir.memmodel import StageMemory
from pipeir.ops import NO_MB, Kind, Op
from pipeir.schedule import Schedule
from pipeir.sim import CostModel, SimResult, Transfer, simulate
from pipeir.verify import peak_bytes

Times = Sequence[tuple[int, float, float]]  # (pc, start, end) per executed instruction


@dataclass(frozen=True)
class RunReport:
    """What `pipeirc run` reports: each measured step (the first, a warm-up, left out when
    there are others) shaped as a simulation of the compiled schedule, and the simulator's
    prediction for it with the measured op times, with the measured transfer time
    (`predicted`) and with free communication (`free`)."""

    steps: tuple[int, ...]  # the steps measured, warm-up included
    measured: tuple[SimResult, ...]  # the kept steps
    predicted: SimResult
    free: SimResult
    latency: float  # seconds per transfer, measured
    step_time: float  # median seconds per kept step

    @property
    def bubble(self) -> float:
        """The median over kept steps of the measured bubble (fraction of the step)."""
        return median(m.bubble for m in self.measured)

    def rank_bubble(self, rank: int) -> float:
        """The median over kept steps of `rank`'s idle fraction."""
        return median(m.idle[rank] / m.makespan for m in self.measured)


def run_report(lowered: Lowered, schedule: Schedule,
               times: Mapping[int, Mapping[int, Times]], step_times: Mapping[int, float],
               dp: int = 1, reduced: Mapping[int, Reduced] | None = None) -> RunReport:
    """The report for one job: `schedule` is the compiled schedule (after its passes, the
    one `lowered` was lowered from), `times[step][rank]` the instruction times of each step
    (of every global rank: with `dp` replicas, replica 0's pipeline is measured and all of
    them time the all-reduces, with `reduced[step]`, as `allreduce_seconds`) and
    `step_times[step]` its duration."""
    replicas = times
    times = {s: {r: t[r * dp] for r in range(lowered.ranks)} for s, t in times.items()}
    steps = tuple(sorted(times))
    keep = steps[1:] if len(steps) > 1 else steps  # the first step warms up
    expanded = expand_rounds(schedule)
    done = {s: {r: (reduced or {}).get(s, {}).get(r * dp, ()) for r in range(lowered.ranks)}
            for s in keep}
    measured = tuple(measured_result(lowered, expanded, times[s], reduced=done[s]) for s in keep)
    kept = [times[s] for s in keep]
    latency = transfer_latency(lowered, kept)
    reduce = allreduce_seconds(lowered, [replicas[s] for s in keep],
                               [(reduced or {}).get(s, {}) for s in keep], dp) if dp > 1 else {}
    return RunReport(steps, measured,
                     calibrated_prediction(lowered, measured, latency, reduce, dp),
                     calibrated_prediction(lowered, measured, 0.0, reduce, dp), latency,
                     median(step_times[s] for s in keep))


def simulated_saved_bytes(schedule: Schedule, saved: Mapping[int, int],
                          kept: Mapping[int, int], for_w: Mapping[int, int] | None = None
                          ) -> tuple[float, ...]:
    """Per rank, the peak saved-activation bytes `pipeir.verify.peak_bytes` predicts for the
    step, with each stage's bytes as measured in the run (`saved[stage]`: what one forward
    saved, `kept[stage]`: the input a checkpointed forward kept, `for_w[stage]`: what W
    still needed after I; a stage missing there keeps everything until W)."""
    def memory(stage: int) -> StageMemory:
        n = float(saved.get(stage, 0))
        w = n if for_w is None or stage not in for_w else min(n, float(for_w[stage]))
        return StageMemory(n, w, float(kept.get(stage, 0)))
    return predicted_saved_bytes(schedule, memory)


def predicted_saved_bytes(schedule: Schedule, memory: Callable[[int], StageMemory]
                          ) -> tuple[float, ...]:
    """Per rank, the peak saved-activation bytes of the step (its `accumulate` rounds back to
    back) with each stage's `memory` (e.g. a cost file's `CostModel.stage_memory`)."""
    return peak_bytes(expand_rounds(schedule), memory)


def expand_rounds(schedule: Schedule) -> Schedule:
    """The schedule run `accumulate` times back to back, as one schedule of k*m micro-batches."""
    c = schedule.config
    if c.accumulate == 1:
        return schedule
    limits.check_ops(f"{c.accumulate} rounds of '{schedule.name}' (accumulate)",
                     c.accumulate * len(schedule))
    last = c.accumulate - 1  # gradient reductions run once, in the last round
    progs = [[op if op.kind == "R" else Op(op.kind, op.stage, op.mb + r * c.microbatches)
              for r in range(c.accumulate) for op in prog if op.kind != "R" or r == last]
             for prog in schedule.programs]
    cfg = PipelineConfig(c.ranks, c.microbatches * c.accumulate, c.stages, c.placement)
    return Schedule.from_programs(cfg, progs, schedule.name)


#: The op each instruction that has its own op kind runs.
_KIND_OF: dict[type, Kind] = {
    Backward: "B", BackwardInput: "I", BackwardWeight: "W", Recompute: "RC", Offload: "OFF",
    Reload: "RELOAD"}


def _op_of(ins: Instr, schedule: Schedule) -> Op | None:
    if isinstance(ins, (Forward, Loss)):
        return _forward(schedule, ins.stage, ins.mb)
    if isinstance(ins, Load):
        return _forward(schedule, 0 if ins.part == "input" else schedule.config.stages - 1,
                        ins.mb)
    kind = _KIND_OF.get(type(ins))
    if kind is None:
        return None
    stage: int = getattr(ins, "stage")  # noqa: B009 - every one of those has stage and mb
    mb: int = getattr(ins, "mb")  # noqa: B009
    return Op(kind, stage, mb)


def _forward(schedule: Schedule, stage: int, mb: int) -> Op:
    f = Op("F", stage, mb)
    return f if f in schedule else Op("FC", stage, mb)


def measured_result(lowered: Lowered, schedule: Schedule, times: Mapping[int, Times],
                    t_zero: float | None = None, reduced: Reduced | None = None) -> SimResult:
    """The measured step as a SimResult (seconds from the step's first compute instruction,
    or from `t_zero` to put several steps on one time line). `schedule` must be
    `expand_rounds` of the compiled schedule; an R op lasts from its post to when its
    all-reduce finished (`reduced[rank]`, else the end of its `wait-reduce`)."""
    # NOTE: the step is timed from the first compute instruction to the last one, on any
    # rank: a rank that enters the step early only to block on a receive (its peers still
    # finishing the previous step) would otherwise stretch the step back in time.
    spans = [(t0, t1) for r in times for pc, t0, t1 in times[r]
             if _op_of(lowered.program(r)[pc], schedule) is not None]
    first = min(t0 for t0, _ in spans)
    t_zero = first if t_zero is None else t_zero
    computed = max(t1 for _, t1 in spans)
    # gradient reductions: from the post (reduce-grad) to the all-reduce's finish
    finish = {r: _reduce_ends(lowered.program(r), times[r], (reduced or {}).get(r, ()))
              for r in times}
    t_end = max([computed, *(t for f in finish.values() for t in f.values())])
    reducing = [0.0] * lowered.ranks
    start: dict[Op, float] = {}
    end: dict[Op, float] = {}
    busy = [0.0] * lowered.ranks
    sent: dict[tuple[str, int, int], tuple[int, float]] = {}
    arrived: dict[tuple[str, int, int], tuple[int, float]] = {}
    for r in range(lowered.ranks):
        prog = lowered.program(r)
        for pc, t0, t1 in times.get(r, ()):
            ins = prog[pc]
            if isinstance(ins, (ReduceGrad, WaitReduce)):
                r_op = Op("R", ins.stage, NO_MB)
                if isinstance(ins, ReduceGrad):
                    start[r_op] = t0 - t_zero
                else:
                    end[r_op] = finish[r][ins.stage] - t_zero
                    reducing[r] += end[r_op] - start.get(r_op, end[r_op])
                continue
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
    makespan = t_end - first
    transfers = [_transfer(key, sent[key], arrived[key], schedule)
                 for key in sorted(sent) if key in arrived]
    return SimResult(schedule, CostModel(unit="s"), "measured", start, end, makespan,
                     tuple(busy), tuple(makespan - b for b in busy), tuple(0.0 for _ in busy),
                     tuple(0 for _ in busy), tuple(0.0 for _ in busy), None, [], transfers,
                     tuple(reducing), computed - first)


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


def transfer_latency(lowered: Lowered, steps: Sequence[Mapping[int, Times]]) -> float:
    """The measured time of one transfer (seconds), for the simulator's `latency`.

    Blocking programs: the mean duration of a blocking send, the time the sender is occupied
    (the simulator's blocking model charges exactly that). Asynchronous programs: from the
    post of a send to the end of the receiver's wait, over the transfers whose receiver was
    already waiting (so the time is the transfer's own, not a wait for the producer); the
    median over all steps, or, when no receiver ever waited, of the part of each wait after
    its send was posted."""
    blocking: list[float] = []
    strict: list[float] = []
    loose: list[float] = []
    for times in steps:
        sent: dict[tuple[str, int, int], float] = {}
        waits: dict[tuple[str, int, int], tuple[float, float]] = {}
        for r in range(lowered.ranks):
            prog = lowered.program(r)
            for pc, t0, t1 in times.get(r, ()):
                ins = prog[pc]
                if isinstance(ins, Send):
                    blocking.append(t1 - t0)
                for c in (ins.posts if isinstance(ins, Batch) else (ins,)):
                    if isinstance(c, (Send, ISend)):
                        sent.setdefault(c.key, t0)
                    elif isinstance(c, (Recv, WaitRecv)):
                        waits[c.key] = (t0, t1)
        for key, (w0, w1) in waits.items():
            if key in sent:
                (strict if w0 <= sent[key] else loose).append(w1 - max(w0, sent[key]))
    if blocking:
        return mean(blocking)
    samples = strict or loose
    return max(0.0, median(samples)) if samples else 0.0


#: per global rank, (stage, when its all-reduce finished) in one step (`RunResult.reduced`)
Reduced = Mapping[int, Sequence[tuple[int, float]]]


def _reduce_ends(prog: Sequence[Instr], times: Times, done: Sequence[tuple[int, float]]
                 ) -> dict[int, float]:
    """Per stage, when one rank's all-reduce of it finished: the finish its work recorded
    (`done`), else the end of its `wait-reduce`."""
    ends = {ins.stage: t1 for pc, _, t1 in times
            if isinstance(ins := prog[pc], WaitReduce)}
    ends.update(done)
    return ends


def allreduce_seconds(lowered: Lowered, steps: Sequence[Mapping[int, Times]],
                      reduced: Sequence[Reduced], dp: int) -> dict[int, float]:
    """Each stage's gradient all-reduce time as the run itself measured it (median over
    steps), whatever overlapped it: from when the simulator starts it (on every replica, the
    later of the end of the compute instruction before its post and the finish of the
    reduction before it on the rank's channel) to when the last replica saw it finish.
    `steps[k]` holds one step's instruction times of all P x D ranks (global rank = pp x dp
    + replica), `reduced[k]` their finish times (a rank without them, e.g. on CUDA, counts the
    end of its `wait-reduce`, later than the finish when the rank had to wait for nothing)."""
    # NOTE: one gloo thread per group runs a rank's all-reduces in the order posted (the
    # simulator's reduction channel), and a collective starts when every replica has started
    # it. Timing from the compute before the post, not from the post, puts what the rank does
    # in between (the post itself, dispatch, up to 0.7 ms on busy shared cores) in the
    # reduction's time, as the simulator has the R op issued the moment that compute ends.
    got: dict[int, list[float]] = {}
    for times, done in zip(steps, reduced):
        ready: dict[int, list[float]] = {}
        end: dict[int, list[float]] = {}
        for g, tt in times.items():
            prog = lowered.program(g // dp)
            finished = _reduce_ends(prog, tt, done.get(g, ()))
            free = issued = float("-inf")  # the channel is free; the last compute ended
            for pc, _, t1 in tt:
                ins = prog[pc]
                if isinstance(ins, COMPUTE):
                    issued = t1
                elif isinstance(ins, ReduceGrad) and ins.stage in finished:
                    ready.setdefault(ins.stage, []).append(max(issued, free))
                    free = finished[ins.stage]
                    end.setdefault(ins.stage, []).append(free)
        for s, posted in ready.items():
            if len(posted) == dp:
                got.setdefault(s, []).append(max(0.0, max(end[s]) - max(posted)))
    return {s: median(v) for s, v in sorted(got.items())}


def exposed_reduction(lowered: Lowered, times: Mapping[int, Times], dp: int,
                      reduced: Reduced | None = None) -> float:
    """How long one measured step waits for gradient all-reduces after its compute: when the
    last all-reduce finished (`reduced`, as `allreduce_seconds`; else the end of its
    `wait-reduce`) minus the end of the last compute instruction, over all P x D ranks
    (`times[global rank]`): the simulator's `exposed_reduction` (the end of the last R minus
    the end of the last compute op; replicas that run behind delay everyone's all-reduce,
    and count). The waiting thread's return after the finish (its wake-up, up to 2 ms on
    busy shared cores) is left out, as the optimizer step is: the simulator models neither."""
    computed = reduced_at = float("-inf")
    for g, tt in times.items():
        prog = lowered.program(g // dp)
        finished = _reduce_ends(prog, tt, (reduced or {}).get(g, ()))
        reduced_at = max([reduced_at, *finished.values()])
        computed = max([computed, *(t1 for pc, _, t1 in tt if isinstance(prog[pc], COMPUTE))])
    return max(0.0, reduced_at - computed) if reduced_at > float("-inf") else 0.0


def calibrated_prediction(lowered: Lowered, measured: Sequence[SimResult],
                          latency: float = 0.0, allreduce: Mapping[int, float] | None = None,
                          dp: int = 1) -> SimResult:
    """The simulator's prediction for the measured steps: op costs set to the measured mean
    time per stage and kind, `latency` per cross-rank transfer, and the communication model of
    the program (`blocking` sends occupy the sender; with overlap they do not). With data
    parallelism, `allreduce` gives each stage's measured all-reduce seconds over `dp`
    replicas (expressed through the cost model's ring formula as the stage's parameter bytes
    over a unit bandwidth)."""
    per_stage: dict[int, dict[str, list[float]]] = {}
    by_kind: dict[str, list[float]] = {}
    for m in measured:
        for op, t0 in m.start.items():
            if op.kind == "R":
                continue
            d = m.end[op] - t0
            per_stage.setdefault(op.stage, {}).setdefault(op.kind, []).append(d)
            by_kind.setdefault(op.kind, []).append(d)
    kw = {k: mean(v) for k, v in by_kind.items()}
    stage = {s: {k: mean(v) for k, v in kinds.items()} for s, kinds in per_stage.items()}
    ring = 2 * (dp - 1) / dp if dp > 1 else 0.0
    for s, t in (allreduce or {}).items():
        if ring:
            stage.setdefault(s, {})["param_bytes"] = t / ring
    costs = CostModel(F=kw.get("F", 1.0), B=kw.get("B"), I=kw.get("I"), W=kw.get("W"),
                      latency=latency, stage=stage, unit="s", dp=dp, dp_latency=0.0,
                      dp_bandwidth=1.0)
    return simulate(measured[-1].schedule, costs,
                    comm="overlapped" if lowered.overlap else "blocking")


def steps_trace(steps: Sequence[SimResult]) -> dict[str, Any]:
    """One Chrome trace of several measured steps (built with a common `t_zero`): each step's
    `chrome_trace`, with flow ids made unique and the step number in every slice's args."""
    from pipeir.views.trace import chrome_trace

    events: list[dict[str, Any]] = []
    seen: set[tuple[str, int, int]] = set()
    out: dict[str, Any] = {}
    for k, result in enumerate(steps):
        out = chrome_trace(result)
        for e in out["traceEvents"]:
            if e["ph"] == "M":
                key = (e["name"], e["pid"], e["tid"])
                if key in seen:
                    continue
                seen.add(key)
            if "id" in e:
                e["id"] = k * 1_000_000 + e["id"]
            if e["ph"] == "X":
                e["args"] = {**e.get("args", {}), "step": k + 1}
            events.append(e)
    out["traceEvents"] = events
    return out
