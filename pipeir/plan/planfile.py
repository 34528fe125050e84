"""The plan file `pipeirc plan -o` writes and `pipeirc run --plan` reads: JSON, versioned.

It holds what a run needs (the model reference, the split points, the schedule as `.sched`
text with the costs it was planned under) and what a reader needs to trust it: the
per-piece costs the plan rests on, the link, the memory budget, the predicted step, its
lower bound and the uniform split's best step. `run` reads only the first group; a newer
pipeir that adds keys keeps its `version` for as long as those keep their meaning.

Versions: 2 adds a piece's `memory_w_bytes` (what W keeps after I; null or absent: all it
saved, as a version 1 file means), so a pipeir that reads only version 1 says so instead
of refusing an unknown key. This one reads both and writes 2.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from pipeir.diagnostics import Source, Span, UsageError
from pipeir.plan.layers import LayerCost, Link, bounds
from pipeir.plan.search import Choice, Plan

FORMAT = "pipeir-plan"
VERSION = 2
#: The versions read (module docstring).
READS = (1, 2)


@dataclass(frozen=True)
class PlanFile:
    """What `run --plan` needs from a plan file."""

    path: str
    model: str
    ranks: int
    microbatches: int
    points: tuple[str, ...]
    schedule: str  # `.sched` text
    comm: str  # "overlapped" (run with the overlap pass) or "blocking"
    layers: tuple[LayerCost, ...]
    link: Link

    def source(self) -> Source:
        """The schedule, named for diagnostics after the plan file."""
        return Source(f"{self.path} (schedule)", self.schedule)


def to_json(plan: Plan, model: str, schedule_text: str, how: str) -> str:
    """The plan file's text; `how` says where the per-piece costs came from."""
    names = [x.name for x in plan.layers]

    def choice(c: Choice) -> dict[str, Any]:
        cand = c.candidate
        return {"points": [names[i] for i in c.cut],
                "stages": [names[lo:hi] for lo, hi in bounds(c.cut, len(names))],
                "schedule": {"family": cand.family, "v": cand.v,
                             "microbatches": cand.microbatches, "passes": cand.passes,
                             "comm": cand.comm},
                "step": cand.step_time, "bubble": cand.bubble,
                "peak_activations": cand.peak_memory,
                "rank_bytes": None if c.rank_bytes is None else list(c.rank_bytes)}

    out = {
        "format": FORMAT, "version": VERSION, "model": model, "ranks": plan.ranks,
        "microbatches": plan.microbatches, **choice(plan.planned),
        "sched": schedule_text,
        "bound": plan.bound, "best_bound": plan.best_bound,
        "uniform": None if plan.uniform is None else choice(plan.uniform),
        "memory": {"budget": None if plan.memory is None else plan.memory.value,
                   "unit": None if plan.memory is None else
                   "bytes" if plan.memory.in_bytes else "activations",
                   "weight_copies": plan.weight_copies,
                   # partial: an I frees what W does not keep (the pieces' memory_w_bytes)
                   "release": "partial" if any(x.memory_w_bytes is not None
                                               for x in plan.layers) else "whole"},
        "costs": {"unit": "ms", "how": how, "latency": plan.link.latency,
                  "bandwidth": plan.link.bandwidth,
                  "layers": [asdict(x) for x in plan.layers]},
    }
    return json.dumps(out, indent=1) + "\n"


def read(path: str) -> PlanFile:
    """Read a plan file; anything malformed is one UsageError naming the file."""
    src = Source.read(path, "plan file")
    try:
        data = json.loads(src.text)
    except json.JSONDecodeError as e:
        raise UsageError(f"malformed JSON plan file: {e.msg}",
                         Span(src, e.lineno, e.colno, e.lineno, e.colno + 1)) from None
    except ValueError:  # integers of over 4300 digits
        raise UsageError(f"{path}: malformed plan file: a number is too long") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UsageError(f"{path}: not a plan file (no \"format\": \"{FORMAT}\"; write one "
                         "with `pipeirc plan -o`)")
    if data.get("version") not in READS:
        raise UsageError(f"{path}: plan file version {data.get('version')!r}; this pipeir "
                         f"reads versions {', '.join(map(str, READS))}")
    try:
        sched = data["schedule"]
        out = PlanFile(path=path, model=_str(data["model"]), ranks=_int(data["ranks"]),
                       microbatches=_int(data["microbatches"]),
                       points=tuple(_str(p) for p in data["points"]),
                       schedule=_str(data["sched"]), comm=_str(sched["comm"]),
                       layers=_layers(data["costs"]["layers"]),
                       link=_link(data["costs"]))
    except KeyError as e:
        raise UsageError(f"{path}: the plan file has no {e}") from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"{path}: malformed plan file: {e}") from None
    if len(out.points) + 1 < out.ranks:
        raise UsageError(f"{path}: {len(out.points)} split points make {len(out.points) + 1} "
                         f"stages, fewer than its {out.ranks} ranks")
    return out


def _layers(raw: Any) -> tuple[LayerCost, ...]:
    names = {f.name for f in fields(LayerCost)}
    out = []
    for item in raw:
        if not isinstance(item, dict) or set(item) - names:
            raise ValueError(f"a piece's costs must be an object of {', '.join(sorted(names))}")
        name = _str(item.get("name"))
        vals = {k: float(v) for k, v in item.items()
                if k != "name" and not (k == "memory_w_bytes" and v is None)}
        if any(not (math.isfinite(v) and v >= 0) for v in vals.values()):
            raise ValueError(f"piece {name!r}: costs must be finite and >= 0")
        if vals.get("memory_w_bytes", 0.0) > vals.get("memory_bytes", 0.0):
            raise ValueError(f"piece {name!r}: memory_w_bytes {vals['memory_w_bytes']:g} is "
                             f"more than its memory_bytes {vals.get('memory_bytes', 0.0):g} "
                             "(it is the part of them that W keeps)")
        out.append(LayerCost(name, **vals))
    if not out:
        raise ValueError("no pieces")
    return tuple(out)


def _link(costs: Any) -> Link:
    latency, bandwidth = float(costs["latency"]), costs["bandwidth"]
    if not (math.isfinite(latency) and latency >= 0):
        raise ValueError(f"latency {latency!r}: expected a finite number >= 0")
    if bandwidth is not None:
        bandwidth = float(bandwidth)
        if not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"bandwidth {bandwidth!r}: expected a positive number or null")
    return Link(latency, bandwidth)


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {type(x).__name__}")
    return x


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"expected a positive integer, got {x!r}")
    return x
