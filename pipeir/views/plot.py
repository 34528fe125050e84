"""A matplotlib Gantt chart of a simulation (the `viz` extra): one lane per rank, a colour per
op kind, micro-batch numbers on the bars, the bubble in the title, optional transfer arrows.

matplotlib is imported only when a chart is drawn, with the Agg backend (no display needed).
"""

from __future__ import annotations

import io
from typing import Any

from pipeir.diagnostics import UsageError
from pipeir.sim.result import SimResult

#: Colours per op kind (colour-blind-safe Okabe-Ito palette), and for blocking sends.
COLOURS = {"F": "#0072B2", "B": "#009E73", "I": "#E69F00", "W": "#CC79A7", "send": "#D55E00"}
NAMES = {"F": "forward", "B": "backward", "I": "input-grad", "W": "weight-grad"}
FORMATS = ("png", "svg", "pdf")
MAX_ARROWS = 2000  # more arrows than this are noise, not information


def _pyplot() -> Any:
    try:
        import matplotlib  # the backend must be chosen before pyplot loads
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("plotting needs matplotlib: pip install 'pipeir[viz]'") from None
    return plt


def render_gantt(result: SimResult, fmt: str = "png", arrows: bool = False,
                 title: str | None = None) -> bytes:
    """The chart as image bytes in `fmt` (png, svg or pdf)."""
    if fmt not in FORMATS:
        raise UsageError(f"cannot draw a '{fmt}' file; use one of {', '.join(FORMATS)}")
    plt = _pyplot()
    from matplotlib.patches import Patch

    ranks = result.ranks
    span = result.makespan or 1.0
    width = min(24.0, max(8.0, len(result.start) / ranks * 0.25))
    fig, ax = plt.subplots(figsize=(width, 1.0 + 0.55 * ranks), dpi=110)
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
            ax.broken_barh([(t0, t1 - t0)], (r - 0.4, 0.8), facecolors=COLOURS[op.kind],
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
    kinds = [k for k in "FBIW" if any(op.kind == k for op in result.start)]
    handles = [Patch(color=COLOURS[k], label=NAMES[k]) for k in kinds]
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
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt)
    plt.close(fig)
    return buf.getvalue()


def _chunk(result: SimResult, op: Any) -> int:
    """Which of its rank's stages `op` belongs to (0 for the first), for shading chunks."""
    c = result.schedule.config
    owned = c.stages_of(c.placement[op.stage]) if 0 <= op.stage < c.stages else ()
    return owned.index(op.stage) if op.stage in owned else 0
