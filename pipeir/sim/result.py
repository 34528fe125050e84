"""What a simulation found: op times, bubble, memory, the critical path and every transfer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.sim.costs import CostModel


@dataclass(frozen=True, slots=True)
class Transfer:
    """One cross-rank message: `src`'s result sent to the rank that runs `dst`.

    `start` is when the send begins (the producer's end, or later in the blocking model when
    the rank is still sending earlier messages) and `end` when the data has arrived.
    """

    src: Op
    dst: Op
    src_rank: int
    dst_rank: int
    start: float
    end: float
    bytes: float


@dataclass(frozen=True)
class SimResult:
    """The outcome of `pipeir.sim.simulate`.

    Times are in the cost model's unit. `bubble` is the idle fraction of the whole step,
    1 - busy / (ranks x makespan); `bubble_vs_ideal` is idle / busy over all ranks (Megatron's
    normalisation: how much longer than a bubble-free step). Memory is counted like
    `pipeir.verify`: +1 at each F, -1 at each B or W, in units of one stage's activations
    for one micro-batch; `peak_time[r]` is when the forward that reaches rank r's peak starts.
    """

    schedule: Schedule
    costs: CostModel
    comm: str
    start: dict[Op, float]
    end: dict[Op, float]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    sending: tuple[float, ...]  # time each rank's compute stream spent sending (blocking)
    peak_activations: tuple[float, ...]  # counted (`pipeir.memunit`; an int where whole)
    peak_time: tuple[float, ...]
    peak_bytes: tuple[float, ...] | None
    critical_path: list[Op]
    transfers: list[Transfer]
    #: time each rank's reduction channel spent all-reducing gradients (R ops)
    reducing: tuple[float, ...] = ()
    #: when the last compute op ended (the step without its reductions); None: unknown
    compute_makespan: float | None = None
    #: time each rank's copy channel spent on offloads and reloads (not in `busy`)
    copying: tuple[float, ...] = ()

    @property
    def has_reductions(self) -> bool:
        return any(r > 0 for r in self.reducing)

    @property
    def reduction_time(self) -> float:
        """The reduction time of the busiest rank: what the reductions would add to the step
        if none of them overlapped compute."""
        return max(self.reducing, default=0.0)

    @property
    def exposed_reduction(self) -> float:
        """How much the reductions lengthen the step: makespan minus the end of the last
        compute op (the step time with reductions exposed vs hidden)."""
        if self.compute_makespan is None:
            return 0.0
        return max(0.0, self.makespan - self.compute_makespan)

    @property
    def hidden_reduction(self) -> float:
        """The fraction of `reduction_time` hidden behind compute (1.0 when nothing is
        reduced)."""
        total = self.reduction_time
        return 1.0 - min(1.0, self.exposed_reduction / total) if total > 0 else 1.0

    @property
    def ranks(self) -> int:
        return len(self.busy)

    @property
    def bubble(self) -> float:
        """Idle fraction of the step: 1 - busy / (ranks x makespan)."""
        if self.makespan <= 0:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy) / (self.ranks * self.makespan))

    @property
    def bubble_vs_ideal(self) -> float:
        """Idle time relative to busy time, summed over ranks (Megatron's bubble figure)."""
        busy = sum(self.busy)
        return sum(self.idle) / busy if busy > 0 else 0.0

    @property
    def utilisation(self) -> tuple[float, ...]:
        """Each rank's busy fraction of the makespan."""
        if self.makespan <= 0:
            return tuple(0.0 for _ in self.busy)
        return tuple(b / self.makespan for b in self.busy)

    @property
    def critical_path_time(self) -> float:
        """The compute time along the critical path (transfers, sends and reductions
        excluded)."""
        return sum(self.end[op] - self.start[op] for op in self.critical_path if op.kind != "R")

    def to_json(self, ops: bool = False) -> dict[str, Any]:
        """A JSON-ready summary; `ops=True` adds every op's times and every transfer."""
        c = self.schedule.config
        out: dict[str, Any] = {
            "schedule": self.schedule.name,
            "ranks": c.ranks,
            "stages": c.stages,
            "microbatches": c.microbatches,
            "comm": self.comm,
            "unit": self.costs.unit,
            "makespan": _num(self.makespan),
            "bubble": _num(self.bubble),
            "bubble_vs_ideal": _num(self.bubble_vs_ideal),
            "peak_activations": list(self.peak_activations),
            "peak_bytes": None if self.peak_bytes is None else [_num(b) for b in self.peak_bytes],
            "per_rank": [
                {"rank": r, "ops": len(self.schedule.program(r)), "busy": _num(self.busy[r]),
                 "idle": _num(self.idle[r]), "sending": _num(self.sending[r]),
                 "utilisation": _num(self.utilisation[r]),
                 "peak_activations": self.peak_activations[r],
                 "peak_time": _num(self.peak_time[r]),
                 "peak_bytes": None if self.peak_bytes is None else _num(self.peak_bytes[r])}
                for r in range(c.ranks)],
            "critical_path": [str(op) for op in self.critical_path],
            "critical_path_time": _num(self.critical_path_time),
            "transfers": len(self.transfers),
            **({"reduction": {"time": _num(self.reduction_time),
                              "exposed": _num(self.exposed_reduction),
                              "hidden": _num(self.hidden_reduction),
                              "compute_makespan": _num(self.compute_makespan or 0.0),
                              "per_rank": [_num(x) for x in self.reducing]}}
               if self.has_reductions else {}),
            "costs": {k: _num(v) if isinstance(v, float) else v
                      for k, v in self.costs.settings().items()},
        }
        if ops:
            out["ops"] = [{"op": str(op), "rank": r, "start": _num(self.start[op]),
                           "end": _num(self.end[op])}
                          for r, prog in enumerate(self.schedule.programs) for op in prog]
            out["transfer_events"] = [
                {"src": str(t.src), "dst": str(t.dst), "src_rank": t.src_rank,
                 "dst_rank": t.dst_rank, "start": _num(t.start), "end": _num(t.end),
                 "bytes": _num(t.bytes)} for t in self.transfers]
        return out


def _num(x: float) -> float | int:
    """Round away float noise (0.30000000000000004) so JSON output is stable and readable."""
    r = round(x, 9)
    return int(r) if r == int(r) and abs(r) < 2**53 else r


def expect_result(value: object, where: str,
                  for_schedule: str = "simulate it first: pipeir.simulate(schedule, costs)"
                  ) -> SimResult:
    """`value`, when it is what `simulate` returns; else a TypeError naming `where` and, for
    a schedule, `for_schedule` (what to do with one instead): a schedule given to a view of
    its simulation read as an AttributeError."""
    if not isinstance(value, SimResult):
        hint = f"; {for_schedule}" if isinstance(value, Schedule) else ""
        raise TypeError(f"{where}: expected what simulate returns (a SimResult), got "
                        f"{type(value).__name__}{hint}")
    return value
