"""`pipeirc check FILE.csv`: will torch's `_PipelineScheduleRuntime` run this file correctly?

Three parts, each naming the offending cell: the compute order (`pipeir.verify`: every op
once, on its stage's rank, no deadlock, memory); for a `compute_only` file, only what torch's
loader accepts there; for a `compute_comms` file, REDUCE_GRAD where torch needs it and the
communication rules of `pipeir.backend.commcheck`, applied to the file lowered as torch runs
it (`pipeir.interop.lowering`).
"""

from __future__ import annotations

from collections.abc import Iterator

from pipeir.backend.commcheck import CommReport, check_comm, check_schedule
from pipeir.diagnostics import Diagnostic, Note, UsageError, VerifyError
from pipeir.interop.actions import BOOKKEEPING
from pipeir.interop.lowering import lower_actions
from pipeir.interop.reader import Imported, load_csv
from pipeir.schedule import Schedule
from pipeir.verify import verify

_TORCH_HANGS = Note("torch accepts such a compute_comms file and then fails, hangs until the "
                    "process-group timeout, or trains on the wrong tensors")


def check_csv(path: str, memory_limit: float | None = None,
              microbatches: int | None = None, lowered: bool = False) -> list[str]:
    """Verify a torch schedule CSV; the lines to print, or a VerifyError naming the cell.
    `lowered` also lowers the compute order as pipeir would run it (`import-torch`, then
    `compile`) and proves that program's communication."""
    imported = load_csv(path, microbatches=microbatches)
    s = imported.schedule
    if not imported.has_comms:
        _compute_only_actions(imported)
    # REDUCE_GRAD (R ops) is checked below in torch's terms, naming cells
    compute = s.with_programs([[op for op in prog if op.kind != "R"] for prog in s.programs])
    report = verify(compute, memory_limit=memory_limit)
    _loss_order(imported)
    c = s.config
    lines = [f"{path}: ok: {c.ranks} ranks, {c.stages} stages, {c.microbatches} micro-batches, "
             f"{len(s)} ops ({imported.format}); peak in-flight activations per rank: "
             f"{' '.join(map(str, report.peak_activations))}"]
    if imported.has_comms:
        comm = prove_comms(imported)
        lines.append(f"{path}: comms ok: {comm.total} transfers over {len(comm.transfers)} rank "
                     f"pairs; every send after the op producing its tensor, every receive "
                     f"before its consumer, each transfer sent and received once in the same "
                     f"order on both sides, REDUCE_GRAD once after each stage's last backward; "
                     f"deadlock-free as torch runs them")
    if lowered:

        lines.append(f"{path}: lowered by pipeir (import-torch, compile): {check_schedule(s)}")
    return lines


def prove_comms(imported: Imported) -> CommReport:
    """Prove that torch's runtime runs the file's sends, receives and REDUCE_GRADs correctly
    and cannot hang; otherwise a VerifyError(check="comm") naming the offending cells. A
    compute-only file has none to prove (torch adds them): a UsageError, not a false
    finding that every receive is missing."""
    if not isinstance(imported, Imported):
        raise TypeError(f"prove_comms: expected an imported torch CSV (what load_csv or "
                        f"loads_csv returns), got {type(imported).__name__}"
                        + ("; for a schedule, pipeir.compile proves its programs"
                           if isinstance(imported, Schedule) else ""))
    if not imported.has_comms:
        raise UsageError(f"{imported.format} file: torch adds its sends and receives itself, "
                         "so there are none to prove; check it with check_csv, or write the "
                         "communication with dumps_csv(schedule, 'compute_comms')")
    lowered, cells = lower_actions(imported)
    try:
        report = check_comm(lowered, cells)
    except VerifyError as e:
        first = next((sp for row in imported.where for sp in row if sp is not None), None)
        name = first.file if first is not None else "<csv>"
        ds = [Diagnostic(_in_torch_words(d.message, name if d.span is None else None),
                         d.span, (*d.notes, _TORCH_HANGS)) for d in e.diagnostics]
        raise VerifyError(ds, check=e.check) from None
    found = list(_reduce_grad(imported))
    if found:
        raise VerifyError(found, check="comm")
    return report


def _in_torch_words(message: str, file: str | None) -> str:
    """A deadlock of the lowered rows is a hang of torch's runtime."""
    _, sep, cycle = message.partition(" deadlock under rendezvous semantics: ")
    if sep:
        message = f"torch's runtime would hang on this schedule: {cycle} wait on each other"
    return f"{file}: {message}" if file is not None else message


def _compute_only_actions(imported: Imported) -> None:
    """torch's `_load_csv(format="compute_only")` takes only compute actions: it adds
    REDUCE_GRAD (and FSDP's UNSHARD/RESHARD) itself, and refuses them in the file."""
    for r, (row, where) in enumerate(zip(imported.actions, imported.where)):
        for k, (a, span) in enumerate(zip(row, where)):
            if a.kind in BOOKKEEPING:
                raise VerifyError(Diagnostic(
                    f"{cell_name(imported, r, k)} in a compute_only file: torch's "
                    f"_PipelineScheduleRuntime refuses it there (ValueError) and adds "
                    f"{', '.join(BOOKKEEPING)} itself; drop it, or place all communication "
                    f"too (compute_comms)", span), check="placement")


def _loss_order(imported: Imported) -> None:
    """torch keeps the last stage's losses in the order its forwards run, and the backward of
    micro-batch k takes the k-th (`_maybe_compute_loss`, `_maybe_get_loss`): the last stage
    must run its forwards in micro-batch order, or a backward differentiates another
    micro-batch's loss (torch: RuntimeError from autograd)."""
    cfg = imported.schedule.config
    last = cfg.stages - 1
    r = cfg.placement[last]
    n = 0
    for k, a in enumerate(imported.actions[r]):
        for x in a.sub or (a,):
            if x.stage == last and x.kind == "F":
                if x.mb != n:
                    raise VerifyError(Diagnostic(
                        f"{cell_name(imported, r, k)} is forward number {n + 1} of the last "
                        f"stage, but for micro-batch {x.mb}: torch keeps the last stage's "
                        f"losses in the order its forwards run and the backward of "
                        f"micro-batch k takes the k-th, so the last stage must run its "
                        f"forwards in micro-batch order ({last}F{n} here)",
                        imported.where[r][k]), check="order")
                n += 1


def _reduce_grad(imported: Imported) -> Iterator[Diagnostic]:
    """REDUCE_GRAD of a stage divides its gradients by the micro-batch count (torch's
    `perform_reduce_grad`): exactly once per stage, after all of its B or W actions."""
    cfg = imported.schedule.config
    m = cfg.microbatches
    for s in range(cfg.stages):
        r = cfg.placement[s]
        row, where = imported.actions[r], imported.where[r]
        grads: list[int] = []  # positions of the stage's weight-gradient actions (B or W)
        reduces: list[int] = []
        for k, a in enumerate(row):
            for x in a.sub or (a,):
                if x.stage == s and x.kind in ("B", "W"):
                    grads.append(k)
                elif x.stage == s and x.kind == "REDUCE_GRAD":
                    reduces.append(k)

        def cell(k: int, r: int = r) -> str:
            return cell_name(imported, r, k)

        if not reduces:
            at = where[grads[-1]] if grads else None
            yield Diagnostic(f"stage {s} has no {s}REDUCE_GRAD on rank {r}: torch divides a "
                             f"stage's gradients by the {m} micro-batches only there, so they "
                             f"come out {m} times too large; place it after "
                             f"{cell(grads[-1]) if grads else 'the last backward'}", at)
            continue
        if len(reduces) > 1:
            yield Diagnostic(f"{cell(reduces[1])} divides stage {s}'s gradients by {m} a "
                             f"second time: REDUCE_GRAD comes once per stage and step",
                             where[reduces[1]], (Note(f"the first: {cell(reduces[0])}",
                                                      where[reduces[0]]),))
        late = [k for k in grads if k > reduces[0]]
        if late:
            yield Diagnostic(f"{cell(reduces[0])} comes before {cell(late[-1])}: torch "
                             f"divides the gradients when REDUCE_GRAD runs, so later "
                             f"backwards are not scaled; it must follow the stage's last "
                             f"B or W", where[reduces[0]],
                             (Note(f"the stage's last backward: {cell(late[-1])}",
                                   where[late[-1]]),))


def cell_name(imported: Imported, rank: int, k: int) -> str:
    """Action `k` (0-based) of `rank`'s row as messages name it: "0F2 (rank 0, action 3 of its
    row, column 9)"."""
    span = imported.where[rank][k]
    col = f", column {span.col}" if span is not None else ""
    return f"{imported.actions[rank][k]} (rank {rank}, action {k + 1} of its row{col})"
