"""A matplotlib Gantt chart of a simulation (the `viz` extra): one lane per rank, a colour per
op kind, micro-batch numbers on the bars, the bubble in the title, optional transfer arrows,
and under it the saved activations per rank over time (bytes when the cost model gives
`memory_bytes`, else activations), counted as `pipeir.memmodel.live_memory` counts them.

matplotlib is imported only when a chart is drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

import io
from typing import Any

from pipeir import limits
from pipeir.diagnostics import UsageError
from pipeir.memmodel import live_memory
from pipeir.ops import CHANNEL, KIND_NAMES
from pipeir.sim.result import SimResult, expect_result

#: Colours per op kind (colour-blind-safe Okabe-Ito palette), and for blocking sends.
COLOURS = {"F": "#0072B2", "B": "#009E73", "I": "#E69F00", "W": "#CC79A7", "send": "#D55E00",
           "FC": "#56B4E9", "RC": "#F0E442", "OFF": "#999999", "RELOAD": "#666666",
           "R": "#000000"}
FORMATS = ("png", "svg", "pdf")
MAX_ARROWS = 2000  # more arrows than this are noise, not information


def _pyplot() -> Any:
    try:
        import matplotlib  # noqa: PLC0415 - the backend must be chosen before pyplot loads
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415 - optional extra (viz)
    except ImportError:
        raise UsageError("plotting needs matplotlib: pip install 'pipeir[viz]'") from None
    return plt


def render_gantt(result: SimResult, fmt: str = "png", arrows: bool = False,
                 title: str | None = None) -> bytes:
    """The chart as image bytes in `fmt` (png, svg or pdf)."""
    expect_result(result, "render_gantt")
    if fmt not in FORMATS:
        raise UsageError(f"cannot draw a '{fmt}' file; use one of {', '.join(FORMATS)}")
    plt = _pyplot()
    from matplotlib.patches import Patch  # noqa: PLC0415 - optional extra (viz)

    ranks = result.ranks
    span = result.makespan or 1.0
    width = min(24.0, max(8.0, len(result.start) / ranks * 0.25))
    fig, (ax, mem) = plt.subplots(2, 1, figsize=(width, 3.2 + 0.55 * ranks), dpi=110,
                                  sharex=True, height_ratios=(1.0 + 0.55 * ranks, 2.2))
    ax.set_xlim(0, span)
    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    unit = f" ({result.costs.unit})" if result.costs.unit else ""
    ax.set_xlabel(f"time{unit}")
    px_per_unit = width * 110 * 0.85 / span
    for r, prog in enumerate(result.schedule.programs):
        for op in prog:
            t0, t1 = result.start[op], result.end[op]
            chunk = _chunk(result, op)
            # a side-channel op (offload, reload, all-reduce) runs beside compute: a thin bar
            # under the lane
            lane = (r + 0.25, 0.2) if op.kind in CHANNEL else (r - 0.4, 0.8)
            ax.broken_barh([(t0, t1 - t0)], lane, facecolors=COLOURS[op.kind],
                           edgecolor="white", linewidth=0.6, alpha=1.0 if chunk % 2 == 0 else 0.7)
            label = str(op.mb)
            if (t1 - t0) * px_per_unit >= 7 * len(label) + 2:
                ax.text((t0 + t1) / 2, r, label, ha="center", va="center", fontsize=7,
                        color="white", fontweight="bold")
    if result.comm == "blocking":
        for tr in result.transfers:
            gap = tr.start - result.end[tr.src]
            ax.broken_barh([(tr.start, tr.end - tr.start)], (tr.src_rank - 0.4, 0.8),
                           facecolors=COLOURS["send"], alpha=0.6 if gap == 0 else 0.4)
    if arrows:
        for tr in result.transfers[:MAX_ARROWS]:
            ax.annotate("", xy=(tr.end, tr.dst_rank), xytext=(result.end[tr.src], tr.src_rank),
                        arrowprops={"arrowstyle": "->", "color": "#555555", "lw": 0.5,
                                    "alpha": 0.6})
    kinds = [k for k in KIND_NAMES if any(op.kind == k for op in result.start)]
    handles = [Patch(color=COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    if result.comm == "blocking":
        handles.append(Patch(color=COLOURS["send"], alpha=0.6, label="sending"))
    if result.schedule.config.stages > ranks:
        handles.append(Patch(color="#777777", alpha=0.7, label="lighter: a rank's odd chunks"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35 / max(1, ranks)
                                                                   - 0.12),
              ncol=len(handles), frameon=False, fontsize=8)
    c = result.schedule.config
    name = title or result.schedule.name
    ax.set_title(f"{name}: p={c.ranks}, m={c.microbatches}, {c.stages} stages, "
                 f"{result.comm} communication\n"
                 f"makespan {result.makespan:.4g}{unit}, bubble {result.bubble:.1%} of the step "
                 f"({result.bubble_vs_ideal:.1%} of the ideal step)", fontsize=10)
    ax.grid(axis="x", color="#dddddd", linewidth=0.5)
    ax.set_axisbelow(True)
    _draw_memory(mem, result)
    mem.set_xlabel(f"time{unit}")
    ax.set_xlabel("")
    for a in (ax, mem):
        for side in ("top", "right"):
            a.spines[side].set_visible(False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    plt.close(fig)
    return buf.getvalue()


def memory_over_time(result: SimResult) -> list[list[tuple[float, float]]]:
    """Per rank, (time, saved activations from then on): each op's `live_memory` value
    from its start (an allocation) or its end (a free: B, I, W, OFF), in bytes when the costs
    give `memory_bytes`, else in activations (`CostModel.op_memory`)."""
    memory = result.costs.op_memory()
    out = []
    for prog in result.schedule.programs:
        steps = [(0.0, 0.0)]
        for op, live in live_memory(prog, memory):
            frees = op.kind in ("B", "I", "W", "OFF")
            steps.append((result.end[op] if frees else result.start[op], live))
        steps.sort(key=_time)
        out.append(steps)
    return out


def _time(step: tuple[float, float]) -> float:
    return step[0]


#: Line styles and widths for the memory lines, rank by rank: ranks often hold the same
#: number of activations at once (GPipe's plateau, 1F1B's steady state), and same-width lines
#: drawn in order hide all but the last. Each later rank is drawn thinner and in another dash
#: on top of the earlier ones, so every rank stays visible where they coincide.
LINE_STYLES = ("-", "--", ":", "-.")


def _draw_memory(ax: Any, result: SimResult) -> None:
    lines = memory_over_time(result)
    top = max((v for steps in lines for _, v in steps), default=0.0)
    unit, scale = limits.binary_unit(top) if result.costs.knows_memory else ("", 1)
    widest, thinnest = 2.8, 0.9
    for r, steps in enumerate(lines):
        xs = [t for t, _ in steps] + [result.makespan]
        ys = [v / scale for _, v in steps] + [steps[-1][1] / scale]
        width = widest - (widest - thinnest) * r / max(1, len(lines) - 1)
        ax.step(xs, ys, where="post", label=f"rank {r}", linewidth=width,
                linestyle=LINE_STYLES[r % len(LINE_STYLES)], zorder=2 + r)
    ax.set_ylabel("saved activations" + (f" ({unit})" if unit else ""), fontsize=8)
    ax.set_ylim(0, (top / scale or 1.0) * 1.08)
    # outside the axes: inside, it covered the lines at their peak
    ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              ncol=1 + (result.ranks - 1) // 8)
    ax.grid(axis="both", color="#eeeeee", linewidth=0.5)


def _chunk(result: SimResult, op: Any) -> int:
    """Which of its rank's stages `op` belongs to (0 for the first), for shading chunks."""
    c = result.schedule.config
    owned = c.stages_of(c.placement[op.stage]) if 0 <= op.stage < c.stages else ()
    return owned.index(op.stage) if op.stage in owned else 0
