"""torch's `compute_comms` actions as pipeir lowered programs, exactly as torch runs them.

NOTE (torch's communication semantics, from `_PipelineScheduleRuntime._step_microbatches`):
SEND_x and RECV_x *post* an isend / irecv (`_batch_p2p`) and never block; `F` of a stage
whose previous stage is on another rank first waits for its posted RECV_F (torch: "Computing
... before receiving input" if none is posted), `B` and `I` likewise for RECV_B; SEND_F reads
the forward's output (`fwd_cache[mb]`, a KeyError before the forward and after the backward
that pops it), SEND_B the backward's input gradient; all sends are waited for at the end of
the step, last posted first. `SEND_F` of stage s goes to the rank of stage s+1 and `RECV_F`
of stage s comes from stage s-1; `SEND_B` / `RECV_B` go the other way. Adjacent stages on
the same rank hand tensors over locally. An OVERLAP_F_B runs its two actions in turn.

So the lowered program of a row is: per action, an `isend` / `irecv`, or the compute
instructions of pipeir's own lowering (`pipeir.backend.lower.compute_instrs`) preceded by
the `wait-recv` torch does and followed by the local hand-off; then one `wait-send` per send.
`pipeir.backend.commcheck` applies the same rules to it as to pipeir's own programs.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeir.backend.commcheck import Site
from pipeir.backend.instructions import (
    Comm,
    Handoff,
    Instr,
    IRecv,
    ISend,
    Lowered,
    OptimizerStep,
    Tensor,
    WaitRecv,
    WaitSend,
    ZeroGrad,
    tag_of,
)
from pipeir.backend.lower import compute_instrs, outputs_of
from pipeir.diagnostics import Span
from pipeir.interop.actions import COMMS, COMPUTE, Action
from pipeir.interop.reader import Imported


@dataclass(frozen=True)
class CellLocator:
    """Names a lowered instruction by the torch action it came from, its rank and its place in
    the row, and points at its CSV cell (`commcheck.Locator`)."""

    cells: dict[str, tuple[int, int, Span]]  # `at` -> (rank, 1-based action number, span)

    def name(self, site: Site) -> str:
        cell = self.cells.get(site.ins.at)
        if cell is None:
            return f"rank {site.rank} (end of step)"
        rank, k, span = cell
        return f"{site.ins.op} (rank {rank}, action {k} of its row, column {span.col})"

    def span(self, site: Site) -> Span | None:
        cell = self.cells.get(site.ins.at)
        return cell[2] if cell is not None else None


def lower_actions(imp: Imported) -> tuple[Lowered, CellLocator]:
    """The rows of a `compute_comms` import as lowered programs, and where each came from."""
    cfg = imp.schedule.config
    programs: list[tuple[Instr, ...]] = []
    cells: dict[str, tuple[int, int, Span]] = {}
    for rank, (row, where) in enumerate(zip(imp.actions, imp.where)):
        prog: list[Instr] = [ZeroGrad()]
        for k, (action, span) in enumerate(zip(row, where), start=1):
            at = f"{span.file}:{span.line}:{span.col}" if span is not None else ""
            if span is not None:
                cells[at] = (rank, k, span)
            for a in action.sub or (action,):
                prog += _instructions(a, rank, imp, str(a), at)
        sends = [c for c in prog if isinstance(c, ISend)]
        prog += [WaitSend(c.tensor, c.stage, c.mb, c.peer, c.tag, op=c.op, at=c.at)
                 for c in reversed(sends)]
        prog.append(OptimizerStep())
        programs.append(tuple(prog))
    return (Lowered(imp.schedule.name, cfg.ranks, cfg.stages, cfg.microbatches, 1,
                    cfg.placement, tuple(programs), overlap=True), CellLocator(cells))


def _instructions(a: Action, rank: int, imp: Imported, op: str, at: str) -> list[Instr]:
    """What torch's runtime does for action `a` on `rank`."""
    cfg = imp.schedule.config
    last, place = cfg.stages - 1, cfg.placement
    if a.kind in COMMS:
        assert a.mb is not None
        tensor: Tensor = "act" if a.kind.endswith("_F") else "grad"
        send = a.kind.startswith("SEND")
        producer = a.stage if send else (a.stage - 1 if tensor == "act" else a.stage + 1)
        other = (a.stage + 1 if tensor == "act" else a.stage - 1) if send else producer
        peer = place[other] if 0 <= other <= last else -1
        cls: type[Comm] = ISend if send else IRecv
        return [cls(tensor, producer, a.mb, peer, tag_of(tensor, producer, a.mb, cfg.stages),
                    op=op, at=at)]
    if a.kind not in COMPUTE:
        return []  # UNSHARD, RESHARD, REDUCE_GRAD: no data moves (see `interop.check`)
    assert a.mb is not None
    s, mb = a.stage, a.mb
    out: list[Instr] = []
    src, needs = (s - 1, "act") if a.kind == "F" else (s + 1, "grad")
    if a.kind != "W" and 0 <= src <= last and place[src] != rank:
        t_in: Tensor = needs  # type: ignore[assignment]
        out.append(WaitRecv(t_in, src, mb, place[src], tag_of(t_in, src, mb, cfg.stages),
                            op=op, at=at))
    out += compute_instrs(a.op, mb, last, 1.0 / cfg.microbatches, (op, at))
    for t, dst in outputs_of(a.op, cfg.stages):
        if place[dst] == rank:
            out.append(Handoff(t, s, mb, op=op, at=at))
    return out
