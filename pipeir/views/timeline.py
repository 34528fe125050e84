"""The ASCII timeline: one row per rank, time scaled to a width, idle time visible.

Each column covers makespan / width time units and shows the op that covers most of it:
its kind letter (F, B, I, W), upper case for even micro-batches and lower case
for odd ones, so neighbouring ops stay apart; '.' is idle and '>' a blocking send. A rank
with gradient reductions (R ops, data parallelism) gets a second row for its reduction
channel ('R', lower case for odd stages), since reductions run beside its compute. With
colour, each kind gets its own background as well.
"""

from __future__ import annotations

from pipeir.ops import CHANNEL, KIND_NAMES, REDUCE, Op
from pipeir.sim.result import SimResult, expect_result

IDLE = "."
SEND = ">"
#: ANSI background colours per op kind (and for sends), used when colour is on.
COLOURS = {"F": "44", "B": "42", "I": "43", "W": "45", "R": "46", "C": "46", "X": "44",
           "O": "40", "L": "40", SEND: "41"}
#: The one character that draws each op kind (F, B, I, W and R are their own).
CELL = {"F": "F", "B": "B", "I": "I", "W": "W", "R": "R", "FC": "C", "RC": "X", "OFF": "O",
        "RELOAD": "L"}
#: What the line of each side channel is called.
CHANNEL_LABELS = {"reduce": "all-reduce", "copy": "copies"}
RESET = "\x1b[0m"


def render_timeline(result: SimResult, width: int = 80, color: bool = False) -> str:
    """The timeline as text, `width` columns of time (plus labels), ending with a newline."""
    expect_result(result, "render_timeline")
    width = max(10, width)
    span = result.makespan
    scale = span / width if span > 0 else 1.0
    lines = [_axis(result, width)]
    label_w = len(f"r{result.ranks - 1}")
    sent_until: dict[Op, float] = {}
    if result.comm == "blocking":
        for tr in result.transfers:
            sent_until[tr.src] = max(tr.end, sent_until.get(tr.src, tr.end))
    for r, prog in enumerate(result.schedule.programs):
        compute = tuple(op for op in prog if op.kind not in CHANNEL)
        cells = _row(result, compute, width, scale, sent_until)
        text = _paint_row(cells) if color else "".join(cells)
        util = result.utilisation[r]
        lines.append(f"{f'r{r}':>{label_w}} |{text}| {util:6.1%}")
        for channel, label in CHANNEL_LABELS.items():
            side = [op for op in prog if CHANNEL.get(op.kind) == channel]
            if side:  # the rank's side channel, on a line of its own
                cells = _channel_row(result, side, width, scale)
                text = _paint_row(cells) if color else "".join(cells)
                lines.append(f"{'':>{label_w}} |{text}| {label}")
    lines.append(_legend(result, color))
    return "\n".join(lines) + "\n"


def _row(result: SimResult, prog: tuple[Op, ...], width: int, scale: float,
         sent_until: dict[Op, float]) -> list[str]:
    """Each column shows what covers most of its time, or idle if the rank is busy for less
    than half of it (sampling one instant per column would drop ops narrower than a column)."""
    best = [0.0] * width
    busy = [0.0] * width
    cells = [IDLE] * width
    for op in prog:
        if op.kind in CHANNEL:
            continue  # on one of the rank's side channels, its own row
        t0, t1 = result.start[op], result.end[op]
        char = CELL[op.kind]
        _cover(t0, t1, char if op.mb % 2 == 0 else char.lower(), scale, best, busy, cells)
        sent = sent_until.get(op, t1)
        if sent > t1:
            _cover(t1, sent, SEND, scale, best, busy, cells)
    return [c if busy[k] >= scale / 2 else IDLE for k, c in enumerate(cells)]


def _channel_row(result: SimResult, ops: list[Op], width: int, scale: float) -> list[str]:
    """A side channel's line: reductions alternate case by stage, copies by micro-batch."""
    best = [0.0] * width
    busy = [0.0] * width
    cells = [IDLE] * width
    for op in ops:
        char = CELL[op.kind]
        if (op.stage if op.kind == REDUCE else op.mb) % 2:
            char = char.lower()
        _cover(result.start[op], result.end[op], char, scale, best, busy, cells)
    return [c if busy[k] >= scale / 2 else IDLE for k, c in enumerate(cells)]


def _cover(t0: float, t1: float, char: str, scale: float, best: list[float],
           busy: list[float], cells: list[str]) -> None:
    width = len(cells)
    for c in range(min(width - 1, int(t0 / scale)), min(width - 1, int(t1 / scale)) + 1):
        overlap = min(t1, (c + 1) * scale) - max(t0, c * scale)
        if overlap > 0:
            busy[c] += overlap
            if overlap > best[c]:
                best[c], cells[c] = overlap, char


def _paint_row(cells: list[str]) -> str:
    """Colour a row, one escape sequence per run of the same kind."""
    out: list[str] = []
    run: list[str] = []
    for c in cells:
        if run and c.upper() != run[-1].upper():
            out.append(_paint("".join(run), True))
            run = []
        run.append(c)
    if run:
        out.append(_paint("".join(run), True))
    return "".join(out)


def _paint(cell: str, color: bool) -> str:
    if not color:
        return cell
    if cell[0] == IDLE:
        return f"\x1b[2m{cell}{RESET}"
    return f"\x1b[{COLOURS[cell[0].upper()]};97m{cell}{RESET}"


def _axis(result: SimResult, width: int) -> str:
    label_w = len(f"r{result.ranks - 1}")
    end = _fmt(result.makespan)
    unit = f" {result.costs.unit}" if result.costs.unit else ""
    gap = max(1, width - 1 - len(end))
    return f"{'':>{label_w}}  0{' ' * gap}{end}{unit}"


def _legend(result: SimResult, color: bool) -> str:
    kinds = sorted({op.kind for op in result.start}, key=list(KIND_NAMES).index)
    parts = [f"{_paint(CELL[k], color)} {KIND_NAMES[k]}" for k in kinds]
    parts.append(f"{_paint(IDLE, color)} idle")
    if result.comm == "blocking":
        parts.append(f"{_paint(SEND, color)} sending")
    return ("legend: " + ", ".join(parts)
            + "; lower case = odd micro-batch; % = busy fraction of the step")


def _fmt(x: float) -> str:
    return f"{x:.6g}"
