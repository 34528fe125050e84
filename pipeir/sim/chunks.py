"""The costs of a model cut into more stages: each stage into v chunks, as interleaving (a
virtual pipeline) cuts it. `pipeirc tune` and `synth` ranking interleaved shapes, and a pass
pipeline whose `interleave` multiplies the stages (`PassContext.for_stages`), read the chunks'
costs from here. (`simulate` does not: it takes a cost file as written for the schedule's own
stages.)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from pipeir.ops import KINDS
from pipeir.sim.costs import CostModel


def rescale(costs: CostModel, ranks: int, v: int, scale: float = 1.0) -> CostModel:
    """`costs` for `ranks * v` virtual stages (chunk s' of physical stage s' // v), every time
    and size scaled by `scale` (another micro-batch count, same global batch)."""
    t = scale / v

    def times(level: dict[str, float] | object) -> dict[str, float]:
        assert isinstance(level, dict)
        out = {}
        for k, x in level.items():
            if k in KINDS:
                out[k] = x * t
            elif k == "activation_bytes":
                out[k] = x * scale
            elif k in ("memory_bytes", "memory_w_bytes"):
                out[k] = x * t
            elif k == "param_bytes":
                out[k] = x / v
        return out

    ratio = _input_grad_ratio(costs)
    stage = {s: times(_chunk(costs.stage[s // v], s // v, s % v, ratio))
             for s in range(ranks * v) if s // v in costs.stage}
    stage_mb = {(p * v + c, m): times(_chunk(level, p, c, ratio))
                for (p, m), level in costs.stage_mb.items() for c in range(v)}
    mb = {m: times(dict(level)) for m, level in costs.mb.items()}
    memory, kept = costs.memory_bytes, costs.memory_w_bytes
    return replace(costs.scaled(t),  # (the top-level times; the levels are the ones above)
                   activation_bytes=costs.activation_bytes * scale,
                   param_bytes=costs.param_bytes / v,
                   memory_bytes=None if memory is None else memory * t,
                   memory_w_bytes=None if kept is None else kept * t,
                   stage=stage, mb=mb, stage_mb=stage_mb)


def _input_grad_ratio(costs: CostModel) -> float:
    """I / W of the stages that have an input gradient (median over the stages after 0 that
    give both, else the defaults), for chunks of stage 0 that are not the first stage."""
    ratios = sorted(lv["I"] / lv["W"] for s, lv in costs.stage.items()
                    if s > 0 and lv.get("I", 0) > 0 and lv.get("W", 0) > 0)
    if ratios:
        return ratios[len(ratios) // 2]
    base = costs.settings()
    i, w = float(base.get("I") or 0.0), float(base.get("W") or 0.0)
    return i / w if i > 0 and w > 0 else 0.0


def _chunk(level: Mapping[str, float], physical: int, chunk: int, ratio: float
           ) -> dict[str, float]:
    """The costs of chunk `chunk` of stage `physical`, before scaling.

    NOTE: a profiled stage 0 has I = 0 and W = B: its input needs no gradient. That holds
    for the first virtual stage only; stage 0's other chunks (virtual stages 1 .. v-1) get
    their input from another chunk and compute its gradient, which the profile never
    measured. It is estimated as W times the I/W ratio of the other stages, and added to B
    (a plain backward computes both)."""
    out = dict(level)
    if physical != 0 or chunk == 0 or out.get("I") != 0 or ratio <= 0:
        return out
    w = out.get("W", out.get("B", 0.0))
    out["I"] = w * ratio
    out["B"] = w + out["I"]
    return out
