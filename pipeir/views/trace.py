"""Chrome / Perfetto trace of a simulation (open in ui.perfetto.dev or chrome://tracing).

One process per rank ("rank r"), a "compute" thread with every op as a complete ("X") event
of its real duration, and "comm" threads with each transfer shown on both the sending and the
receiving rank, and an "all-reduce" thread with the gradient reductions of data parallelism.
A flow arrow ("s" then "f", same id, binding to the enclosing slice) runs
from each send to its receive. Transfers that overlap in time on one rank go on separate comm
threads ("comm", "comm 2", ...), because a trace viewer draws one thread as a single stack.
"""

from __future__ import annotations

from typing import Any

from pipeir.ops import CHANNEL, FORWARDS
from pipeir.sim.result import SimResult, Transfer, expect_result

#: Trace timestamps are microseconds; one time unit of the cost model is drawn as this many.
US_PER_UNIT = {"s": 1e6, "ms": 1e3, "us": 1.0, "µs": 1.0, "ns": 1e-3}
DEFAULT_US_PER_UNIT = 1e3  # unitless costs are drawn as milliseconds
COMPUTE_TID = 0
REDUCE_TID = 1000  # gradient all-reduces (data parallelism), below the comm threads
COPY_TID = 1001  # offloads and reloads: the rank's copy channel to host memory


def chrome_trace(result: SimResult) -> dict[str, Any]:
    """The trace as a JSON-ready dict with a `traceEvents` list."""
    expect_result(result, "chrome_trace")
    scale = US_PER_UNIT.get(result.costs.unit or "", DEFAULT_US_PER_UNIT)
    events: list[dict[str, Any]] = []
    for r, prog in enumerate(result.schedule.programs):
        events.append(_meta("process_name", r, 0, {"name": f"rank {r}"}))
        events.append(_meta("process_sort_index", r, 0, {"sort_index": r}))
        events.append(_meta("thread_name", r, COMPUTE_TID, {"name": "compute"}))
        if any(CHANNEL.get(op.kind) == "copy" for op in prog):
            events.append(_meta("thread_name", r, COPY_TID, {"name": "copy (host memory)"}))
        for op in prog:
            t0 = result.start[op]
            if op.kind == "R":  # gradient all-reduce: the rank's reduction channel
                if not any(e.get("tid") == REDUCE_TID and e["pid"] == r for e in events):
                    events.append(_meta("thread_name", r, REDUCE_TID, {"name": "all-reduce"}))
                events.append({"name": f"all-reduce stage {op.stage}", "cat": "R", "ph": "X",
                               "pid": r, "tid": REDUCE_TID, "ts": _ts(t0, scale),
                               "dur": _ts(result.end[op] - t0, scale),
                               "args": {"op": str(op), "stage": op.stage}})
                continue
            tid = COPY_TID if op.kind in CHANNEL else COMPUTE_TID
            events.append({"name": f"{op.kind}{op.mb}", "cat": op.kind, "ph": "X",
                           "pid": r, "tid": tid, "ts": _ts(t0, scale),
                           "dur": _ts(result.end[op] - t0, scale),
                           "args": {"op": str(op), "stage": op.stage, "microbatch": op.mb}})
    lanes = _Lanes()
    for n, tr in enumerate(result.transfers):
        send_tid = lanes.place(tr.src_rank, tr.start, tr.end)
        recv_tid = lanes.place(tr.dst_rank, tr.start, tr.end)
        ts, dur = _ts(tr.start, scale), _ts(tr.end - tr.start, scale)
        args = {"src": str(tr.src), "dst": str(tr.dst), "bytes": tr.bytes}
        events.append({"name": f"send {_what(tr)} to rank {tr.dst_rank}", "cat": "comm",
                       "ph": "X", "pid": tr.src_rank, "tid": send_tid, "ts": ts, "dur": dur,
                       "args": args})
        events.append({"name": f"recv {_what(tr)} from rank {tr.src_rank}", "cat": "comm",
                       "ph": "X", "pid": tr.dst_rank, "tid": recv_tid, "ts": ts, "dur": dur,
                       "args": args})
        flow = {"name": "p2p", "cat": "comm", "id": n, "bp": "e"}
        events.append({**flow, "ph": "s", "pid": tr.src_rank, "tid": send_tid, "ts": ts})
        events.append({**flow, "ph": "f", "pid": tr.dst_rank, "tid": recv_tid,
                       "ts": _ts(tr.end, scale)})
    for r, tid in lanes.used():
        name = "comm" if tid == 1 else f"comm {tid}"
        events.append(_meta("thread_name", r, tid, {"name": name}))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": result.schedule.name, "comm": result.comm,
                          "makespan": result.makespan, "bubble": result.bubble,
                          "unit": result.costs.unit or "unitless (drawn as ms)"}}


def _what(tr: Transfer) -> str:
    """What travels: activations forward, gradients backward."""
    kind = "act" if tr.src.kind in FORWARDS else "grad"
    return f"{kind} {tr.src.mb} ({tr.src.stage}->{tr.dst.stage})"


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _ts(t: float, scale: float) -> float:
    return round(t * scale, 3)


class _Lanes:
    """Greedy interval colouring per rank: the first comm thread free at a transfer's start."""

    def __init__(self) -> None:
        self._free: dict[int, list[float]] = {}  # rank -> when each lane frees up

    def place(self, rank: int, start: float, end: float) -> int:
        lanes = self._free.setdefault(rank, [])
        for k, busy_until in enumerate(lanes):
            if busy_until <= start:
                lanes[k] = end
                return k + 1
        lanes.append(end)
        return len(lanes)

    def used(self) -> list[tuple[int, int]]:
        return [(r, k + 1) for r, lanes in sorted(self._free.items()) for k in range(len(lanes))]
