"""The communication rules of lowered programs, and the proof that a program obeys them.

One rule set serves pipeir's own lowered programs (`check --lowered`, every `compile`) and
torch's `compute_comms` schedules, which `pipeir.interop.lowering` writes as lowered programs
exactly as `_PipelineScheduleRuntime` executes them (isend/irecv posted in file order, a wait
for the receive inside the compute that consumes it, every send waited at the end).

Semantics are the strictest a backend may have: posting (isend, irecv, a batch) never blocks;
a blocking send or receive, and a wait, complete only once the matching side is posted
(*rendezvous*); and point-to-point messages between two ranks are matched in the order they
are posted, whatever the tags (*per-pair FIFO*, as NCCL does, and gloo with torch's tag 0).

NOTE (the rules, in the order they are checked; each later rule assumes the earlier hold):

1. *Local*, per rank in program order: a tensor is sent only after the instruction producing
   it and while it is still held (an activation until its stage's backward of that
   micro-batch, when torch frees it); a compute that consumes a tensor from another rank
   comes after the wait for its receive, one from the same rank after its hand-off; a wait
   follows its post (a `wait-sends` waits for every send posted before it); a receive is
   not posted twice while the first is outstanding; stage, micro-batch and peer agree with
   the placement; inside an overlapped pair there is only the pair's compute.
2. *Matching*: every transfer the placement implies is sent exactly once and received
   exactly once, with the same tag on both sides (gloo matches by tag). *Computing*: every
   stage runs, per micro-batch, one forward, the loss on the last stage, and one backward
   (B, or I then W), in that order: a compute whose output no rank receives (stage 0's
   backward, a W) is otherwise unobserved by the other rules.
   *Stepping*: each program clears the gradients once before its computes and steps once
   after them; with gradient reductions, every stage reduces once after its last weight
   gradient and waits for it before the step.
3. *Order*: between each sender and receiver, sends and receives are posted in the same
   order. Two transfers posted in opposite orders either deadlock (blocking) or deliver each
   other's tensors (asynchronous): with equal shapes training silently goes wrong.
4. *Progress*: running all ranks abstractly, every program ends; otherwise the chain of
   ranks waiting on each other is named.

Posts inside a `batch` (torch's `batch_isend_irecv`) are posted in their listed order at the
batch's position, so all rules apply to them as to single posts.

Findings name the instruction (`Locator.name`) and point at its source (`Locator.span`): the
`.sched` op for pipeir's programs, the CSV cell for torch's, the mnemonic of the instruction's
row in a lowered JSON file (`check --lowered DIR/lowered.json`).

The package holds one module per rule: `local` (1), `matching` (2: matching, computing,
stepping), `order` (3) and `progress` (4), over the shared `programs` and `findings`.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipeir import jsonread
from pipeir._gc import paused_gc
from pipeir.backend import instructions, program_io, program_read
from pipeir.backend.commcheck.findings import (
    Channel,
    Finding,
    Key,
    Locator,
    PlainLocator,
    Site,
    describe,
    what,
)
from pipeir.backend.commcheck.local import Local
from pipeir.backend.commcheck.matching import Matching
from pipeir.backend.commcheck.order import Order
from pipeir.backend.commcheck.progress import explain, run
from pipeir.backend.instructions import Lowered
from pipeir.backend.lower import lower
from pipeir.backend.program_io import is_proved
from pipeir.backend.program_read import instruction_spans, load
from pipeir.diagnostics import Diagnostic, Note, Source, Span, VerifyError

if TYPE_CHECKING:
    from pipeir.schedule import Schedule

__all__ = ["CommReport", "JsonLocator", "Key", "Locator", "PlainLocator", "Site", "check_comm",
           "check_json", "check_schedule", "describe", "instruction_spans", "prove_file",
           "rules_id", "schedule_locator", "summary", "what"]


@dataclass(frozen=True)
class CommReport:
    """What the proof established: the number of transfers per (sender, receiver) pair."""

    transfers: dict[Channel, int]

    @property
    def total(self) -> int:
        return sum(self.transfers.values())



def _diagnostic(f: Finding, loc: Locator) -> Diagnostic:
    notes = tuple(Note(f"{text}: {loc.name(s)}" if s is not None else text,
                       loc.span(s) if s is not None else None) for text, s in f.notes)
    if f.site is None:
        return Diagnostic(f.message, loc.span(f.near) if f.near is not None else None, notes)
    return Diagnostic(f"{loc.name(f.site)} {f.message}", loc.span(f.site), notes)


#: The most findings of one rule reported: past them the rest say the same thing again.
MAX_FINDINGS = 50


@paused_gc()  # (pipeir._gc: a few objects per instruction, no cycles)
def check_comm(lowered: Lowered, locator: Locator | None = None) -> CommReport:
    """Prove that `lowered` obeys the communication rules (module NOTE) and cannot deadlock;
    raise VerifyError(check="comm") with one diagnostic per finding of the first rule that
    fails otherwise."""
    loc: Locator = locator if locator is not None else PlainLocator()
    report = _rules(lowered, loc)  # (their per-transfer sides are let go before the run)
    pc, waits_on = run(lowered)
    stuck = [r for r in range(len(lowered.programs)) if pc[r] < len(lowered.programs[r])]
    if stuck:
        raise VerifyError(explain(lowered, pc, stuck, waits_on, loc), check="comm")
    return report


def _rules(lowered: Lowered, loc: Locator) -> CommReport:
    """Rules 1 to 3 (the package NOTE), raising at the first that fails; the transfers.

    NOTE (memory): computing (rule 2b) is checked before matching builds the channels'
    sides, which matching and order share, and reported after matching: a large program's
    proof peaked where computing's per-op index and the sides were alive together. It reads
    only computes and loads, so what matching would find changes nothing it finds."""
    matching = Matching(lowered)
    order = Order(lowered, shared=matching)
    _report(_found(Local(lowered).rule_local), loc)
    computing = _found(matching.rule_compute)
    _report(_found(matching.rule_matching), loc)
    _report(computing, loc)
    del computing
    for rule in (matching.rule_step, order.rule_order):
        _report(_found(rule), loc)
    return CommReport({ch: len(q) for ch, q in sorted(matching.sides()[0].items())})


def _found(rule: Callable[[], Iterator[Finding]]) -> list[Finding]:
    """A rule's findings, one more than are reported at most."""
    return list(itertools.islice(rule(), MAX_FINDINGS + 1))


def _report(found: list[Finding], loc: Locator) -> None:
    """Raise a rule's findings (`_found`), if it has any."""
    if found:
        shown = [_diagnostic(f, loc) for f in found[:MAX_FINDINGS]]
        if len(found) > MAX_FINDINGS:
            shown.append(Diagnostic(f"... and more like these (the first {MAX_FINDINGS} "
                                    "are shown)", None, ()))
        raise VerifyError(shown, check="comm")


def summary(lowered: Lowered, report: CommReport) -> str:
    kind = "asynchronous (overlap)" if lowered.overlap else "blocking"
    return (f"lowered ok: {report.total} {kind} transfers over {len(report.transfers)} rank "
            f"pairs; deadlock-free under rendezvous semantics with per-peer FIFO matching")


@functools.cache
def rules_id() -> str:
    """Names the rules this pipeir proves with: a digest of their source (this package, the
    instruction set, the lowered-JSON format and its reader), so that a lowered.json proved
    under other rules is proved again (`program_io`'s NOTE on the recorded proof)."""
    h = hashlib.sha256()
    files = sorted(Path(__file__).parent.glob("*.py"))
    for path in (*files, Path(instructions.__file__), Path(program_io.__file__),
                 Path(program_read.__file__), Path(jsonread.__file__)):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return "commcheck " + h.hexdigest()


def prove_file(lowered: Lowered, source: Source) -> None:
    """What a compiled program's main.py runs before its ranks start: `check_comm` of the
    lowered.json read from `source`, found as `check --lowered` finds it, unless the file is
    exactly what `pipeirc compile` proved under these rules (its recorded digest,
    `program_io.is_proved`): then the proof is not run again on every rank."""
    if not is_proved(source.text, rules_id()):
        check_comm(lowered, JsonLocator(source))


def schedule_locator(schedule: Schedule) -> PlainLocator:
    """Points findings in `schedule`'s lowered programs at the ops' `.sched` spans."""
    spans = {}
    for op in schedule:
        span = schedule.span_of(op)
        if span is not None:
            spans[str(op)] = span
    return PlainLocator(spans)


def check_schedule(schedule: Schedule) -> str:
    """Lower `schedule` (blocking communication) and prove it; a one-line summary."""
    lowered = lower(schedule)
    return summary(lowered, check_comm(lowered, schedule_locator(schedule)))


@paused_gc()  # (reading and proving, both paused, as one: pipeir.cli.compile's NOTE)
def check_json(path: str) -> str:
    """Prove the lowered programs in a `lowered.json` file; `path: summary`. A file that is
    not lowered programs (bad JSON, or a field of the wrong shape or type) is a UsageError
    naming the field (`from_json`), never a traceback from the rules."""
    lowered, source = load(path)
    return f"{path}: {summary(lowered, check_comm(lowered, JsonLocator(source)))}"


@dataclass
class JsonLocator:
    """Names an instruction as `describe` does; points at its row's mnemonic in `source`, a
    lowered JSON file (`instruction_spans`), found only when a finding needs it."""

    source: Source
    _spans: dict[tuple[int, int], Span] | None = field(default=None, init=False)

    def name(self, site: Site) -> str:
        return describe(site)

    def span(self, site: Site) -> Span | None:
        if self._spans is None:
            self._spans = instruction_spans(self.source)
        return self._spans.get((site.rank, site.pc))
