"""The pass manager: the one place passes run. It verifies after every pass and blames the
pass that broke the schedule; `compile` goes on through lowering and the lowered-level passes
to programs proved deadlock-free.

Debugging output comes from instruments the caller attaches (print-after, dump-to-dir,
timing), never from prints inside passes, so the library stays quiet and the CLI decides
where text goes. Costs reach the passes that need them through the `PassContext` handed to
the manager, never through a global.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from pipeir._gc import paused_gc
from pipeir.backend.commcheck import check_comm
from pipeir.backend.lower import lower_verified
from pipeir.diagnostics import Diagnostic, Note, PipeirError, UsageError, VerifyError
from pipeir.files import make_dir, write_atomic
from pipeir.passes.base import LoweredPass, Pass, PassBase
from pipeir.passes.context import (
    DEFAULT_CONTEXT,
    UNIT_COSTS,
    PassContext,
    callers_level,
    costless_message,
    printed_costs,
)
from pipeir.passes.pipeline import Pipeline
from pipeir.passes.verify import Verify
from pipeir.printer import print_schedule
from pipeir.schedule import Schedule, expect_schedule
from pipeir.sim.costs import CostModel
from pipeir.usercode import UserCodeError, contained
from pipeir.verify import verify

if TYPE_CHECKING:
    from pipeir.backend.instructions import Instr, Lowered


class Instrument:
    """Hooks around a pipeline run; subclass and override what you need."""

    def before_pipeline(self, schedule: Schedule) -> None:
        """Called once with the input schedule."""

    def after_pass(self, index: int, p: Pass, schedule: Schedule, seconds: float,
                   verify_seconds: float) -> None:
        """Called after pass number `index` (1-based) ran and, if enabled, verified."""

    def planned_under(self, context: PassContext) -> None:
        """The context the schedule of the next hook is planned under: after a pass that
        changes the stage count, the costs cut into the new stages (`for_stages`)."""

    def after_pipeline(self, schedule: Schedule) -> None:
        """Called once with the final schedule."""

    def phase(self, text: str) -> None:
        """Called as a run enters a phase: verifying, a pass, lowering, the proof."""


class Phases(Instrument):
    """Hands each phase to `show` (the CLI's one-line progress display, `pipeir.progress`)."""

    def __init__(self, show: Callable[[str], None]):
        self.show = show

    def phase(self, text: str) -> None:
        self.show(text)


class PrintAfter(Instrument):
    """Print the canonical text after the passes named in `names` ("all" for every one)."""

    def __init__(self, names: Collection[str], stream: TextIO):
        self.names = set(names)
        self.stream = stream

    def after_pass(self, index: int, p: Pass, schedule: Schedule, seconds: float,
                   verify_seconds: float) -> None:
        if "all" in self.names or p.name in self.names:
            self.stream.write(f"# ---- after pass {index}: {p.spec()} ----\n")
            self.stream.write(print_schedule(schedule))


class DumpDir(Instrument):
    """Write `00-input.sched`, `01-<pass>.sched`, ... in canonical form into `directory`,
    each with the costs it is planned under (`printed_costs`; `settings`, the input file's),
    so every file simulates as the passes saw it."""

    def __init__(self, directory: str | Path,
                 write: Callable[[Path, str], None] | None = None,
                 settings: Mapping[str, object] | None = None):
        self.directory = make_dir(directory, "--dump-dir")
        self.write = write or write_atomic
        self.settings = dict(settings or {})
        self.context = DEFAULT_CONTEXT
        self.stages = 0

    def planned_under(self, context: PassContext) -> None:
        self.context = context

    def _text(self, schedule: Schedule) -> str:
        return print_schedule(schedule, printed_costs(self.context, self.settings, self.stages,
                                                      schedule.config.stages))

    def before_pipeline(self, schedule: Schedule) -> None:
        self.stages = schedule.config.stages
        self.write(self.directory / "00-input.sched", self._text(schedule))

    def after_pass(self, index: int, p: Pass, schedule: Schedule, seconds: float,
                   verify_seconds: float) -> None:
        self.write(self.directory / f"{index:02d}-{p.name}.sched", self._text(schedule))


class TimePasses(Instrument):
    """Collect each pass's run and verify time; `report()` formats them as a table."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self.rows: list[tuple[str, float, float]] = []

    def after_pass(self, index: int, p: Pass, schedule: Schedule, seconds: float,
                   verify_seconds: float) -> None:
        self.rows.append((p.spec(), seconds, verify_seconds))

    def after_pipeline(self, schedule: Schedule) -> None:
        if self.stream is not None:
            self.stream.write(self.report())

    def report(self) -> str:
        width = max([len("pass"), *(len(name) for name, _, _ in self.rows)])
        lines = [f"{'pass':<{width}}  {'run ms':>9}  {'verify ms':>9}"]
        for name, run, ver in self.rows:
            lines.append(f"{name:<{width}}  {run * 1e3:9.2f}  {ver * 1e3:9.2f}")
        total_run = sum(r for _, r, _ in self.rows)
        total_ver = sum(v for _, _, v in self.rows)
        lines.append(f"{'total':<{width}}  {total_run * 1e3:9.2f}  {total_ver * 1e3:9.2f}")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Optimized:
    """A schedule after its passes, and the context its costs are in: the caller's, or, when
    a pass changed the number of stages, that context cut to the new stages
    (`PassContext.for_stages`), which the passes after it planned with."""

    schedule: Schedule
    context: PassContext


@dataclass(frozen=True)
class Compiled:
    """A schedule after its passes, and the per-rank programs it lowered to (after the
    lowered-level passes, proved deadlock-free). Everything downstream (codegen, the runtime,
    the `run` report, `tune`) reads the schedule that actually runs from here."""

    schedule: Schedule
    lowered: Lowered
    context: PassContext


class PassManager:
    """Run passes in order. With `verify_each` (the default) the input is verified first and
    the output of every pass after it, so a failure names the pass that caused it.

    `run` takes schedule-level passes only; `compile` takes a pipeline of schedule-level
    passes followed by lowered-level ones (`overlap`) and lowers in between."""

    def __init__(self, pipeline: Pipeline | Sequence[PassBase], *,
                 context: PassContext = DEFAULT_CONTEXT, verify_each: bool = True,
                 instruments: Sequence[Instrument] = ()):
        if isinstance(pipeline, str):
            raise TypeError(f"PassManager takes passes, not a pipeline string: "
                            f"PassManager(parse_pipeline({pipeline!r}))")
        if not isinstance(context, PassContext):
            raise TypeError(f"PassManager(context=...): expected a PassContext, got "
                            f"{type(context).__name__}" + (
                                ": give costs as PassContext(costs=...)"
                                if isinstance(context, CostModel) else ""))
        if type(verify_each) is not bool:  # ("no" is true)
            raise TypeError(f"PassManager(verify_each=...): expected True or False, got "
                            f"{verify_each!r}")
        self.pipeline = pipeline if isinstance(pipeline, Pipeline) else Pipeline.of(pipeline)
        self.context = context
        if context.costs is UNIT_COSTS:
            for name in dict.fromkeys(p.name for p in self.pipeline.passes if p.costed):
                warnings.warn(costless_message(name, "give pipeir.compile costs=..., or "
                                                     "PassManager a PassContext with costs"),
                              stacklevel=callers_level())
        self.verify_each = verify_each
        self.instruments = tuple(instruments)
        for inst in self.instruments:
            if not isinstance(inst, Instrument):
                raise TypeError(f"PassManager(instruments=...): expected Instrument objects "
                                f"(TimePasses(), PrintAfter(...), or a subclass of "
                                f"Instrument), got {inst!r}")

    def run(self, schedule: Schedule) -> Schedule:
        """The schedule after every pass of the pipeline (all schedule-level)."""
        return self.optimize(schedule).schedule

    def optimize(self, schedule: Schedule) -> Optimized:
        """`run`, with the context the result's costs are in (`PassContext.for_stages`)."""
        for p, span in zip(self.pipeline.passes, self.pipeline.spans):
            if isinstance(p, LoweredPass):
                raise UsageError(
                    f"pass '{p.name}' works on lowered per-rank programs, not on schedules; "
                    "give it to `pipeirc compile` or `pipeirc run --passes`", span)
        return self._run_schedule(schedule, len(self.pipeline.passes))

    def compile(self, schedule: Schedule) -> Compiled:
        """Run the schedule-level passes, lower (placing communication by the context's
        costs), run the lowered-level passes, and prove the programs deadlock-free."""

        passes, spans = self.pipeline.passes, self.pipeline.spans
        n = next((i for i, p in enumerate(passes) if isinstance(p, LoweredPass)), len(passes))
        for i in range(n, len(passes)):
            if not isinstance(passes[i], LoweredPass):
                raise UsageError(f"pass '{passes[i].name}' works on schedules and cannot follow "
                                 f"'{passes[n].name}', which works on lowered programs; put "
                                 "the schedule passes first", spans[i])
        done = self._run_schedule(schedule, n)
        schedule, context = done.schedule, done.context
        self._phase(f"lowering {len(schedule):,} ops")
        if not self.verify_each:
            verify(schedule)  # (as `lower` would)
        # (with verify_each, `_run_schedule` verified it: as the input or a pass's output)
        first = passes[n] if n < len(passes) else None
        if isinstance(first, LoweredPass) and first.rank_local:
            lowered = self._lower_then(schedule, context, n)
            n += 1
            if self.verify_each:
                self._prove(lowered, n - 1)
        else:
            lowered = lower_verified(schedule, context.costs)
        # NOTE (memory): nothing reads a lowered pass's input once it has run (holding it
        # while a large program is proved raised compile's peak; `lower` drops the
        # schedule's numbered index likewise)
        for i in range(n, len(passes)):
            p = passes[i]
            assert isinstance(p, LoweredPass)
            self._phase(f"{self._where(i)}")
            try:
                with _user_code(p, self._where(i)):
                    lowered = p.run(lowered, context)
            except PipeirError as e:
                raise self._blame(e, i, during=True) from None
            if self.verify_each:
                self._prove(lowered, i)
        if not (self.verify_each and first is not None):  # (else proved after the last pass)
            self._phase(f"proving {sum(map(len, lowered.programs)):,} instructions "
                        "deadlock-free")
            check_comm(lowered)
        return Compiled(schedule, lowered, context)

    def _lower_then(self, schedule: Schedule, context: PassContext, i: int) -> Lowered:
        """Lowering with the rank-local pass number `i` run on each program as it is made
        (`lower_verified`'s `then`): what lowering and then the pass's `run` would give."""
        p = self.pipeline.passes[i]
        assert isinstance(p, LoweredPass)
        started = False
        # (split programs unless a subclass overrides `run_rank` below the `run_split` it
        # inherits: lowering would hand the split past the override)
        split = p.splits and issubclass(_owner(p, "run_split"), _owner(p, "run_rank"))

        def then(program: Any) -> tuple[Instr, ...]:
            nonlocal started
            if not started:
                started = True
                self._phase(self._where(i))
            try:
                with _user_code(p, self._where(i)):
                    return p.run_split(program) if split else p.run_rank(program)
            except PipeirError as e:
                raise self._blame(e, i, during=True) from None

        lowered = lower_verified(schedule, context.costs, split=then) if split else \
            lower_verified(schedule, context.costs, then)
        return lowered if p.comm is None else \
            dataclasses.replace(lowered, overlap=p.comm == "overlapped")

    def _prove(self, lowered: Lowered, i: int) -> None:
        """The proof after pass number `i`, a lowered pass; its findings blame the pass."""
        self._phase(f"proving {sum(map(len, lowered.programs)):,} instructions deadlock-free")
        try:
            check_comm(lowered)
        except PipeirError as e:
            raise self._blame(e, i, during=False) from None

    def _phase(self, text: str) -> None:
        for inst in self.instruments:
            inst.phase(text)

    def _run_schedule(self, schedule: Schedule, n: int) -> Optimized:
        expect_schedule(schedule, "PassManager")

        passes, spans = self.pipeline.passes, self.pipeline.spans
        context = self.context
        if self.verify_each:
            self._phase(f"verifying {len(schedule):,} ops")
            try:  # (counted with the costs' split, as `check` counts: pipeir.memunit)
                verify(schedule, sizes=context.costs)
            except VerifyError as e:
                raise _prefixed(e, "the input schedule is invalid, before any pass ran") from None
        for inst in self.instruments:
            inst.planned_under(context)
            inst.before_pipeline(schedule)
        for i in range(n):
            p = passes[i]
            assert isinstance(p, Pass)
            self._phase(self._where(i))
            t0 = time.perf_counter()
            try:
                with _user_code(p, self._where(i)):
                    out = p.run(schedule, context)
            except PipeirError as e:
                raise self._blame(e, i, during=True) from None
            except Exception as e:
                e.add_note(f"while running {self._where(i)}")
                raise
            t1 = time.perf_counter()
            if not isinstance(out, Schedule):
                raise VerifyError(Diagnostic(
                    f"pass '{p.name}' returned {type(out).__name__}, not a Schedule", spans[i]),
                    check="pass")
            changed = _reshaped(schedule, out)
            if changed is not None:
                raise VerifyError(Diagnostic(
                    f"pass '{p.name}' changed {changed}: a pass reorders or splits the work of "
                    f"the pipeline it is given, which runs on the same ranks, micro-batches and "
                    f"accumulation rounds (only its stages may change, as interleave's do)",
                    spans[i]), check="pass")
            context = context.for_stages(schedule.config.stages, out.config.stages)
            if self.verify_each and not isinstance(p, Verify):
                try:
                    verify(out, sizes=context.costs)
                except VerifyError as e:
                    raise self._blame(e, i, during=False) from None
            t2 = time.perf_counter()
            for inst in self.instruments:
                inst.planned_under(context)
                inst.after_pass(i + 1, p, out, t1 - t0, t2 - t1)
            schedule = out
        for inst in self.instruments:
            inst.after_pipeline(schedule)
        return Optimized(schedule, context)

    def _where(self, i: int) -> str:
        passes = self.pipeline.passes
        return f"pass {i + 1} of {len(passes)}, '{passes[i].spec()}'"

    def _blame(self, e: PipeirError, i: int, during: bool) -> PipeirError:

        passes, span = self.pipeline.passes, self.pipeline.spans[i]
        before = ", ".join(p.spec() for p in passes[:i])
        if during and isinstance(passes[i], Verify):
            prefix = passes[i].spec() + (f" after {before}" if before else "")
            note = f"{self._where(i)}, found the schedule invalid"
        elif during:
            prefix = f"in {passes[i].spec()}" + (f" after {before}" if before else "")
            note = f"{self._where(i)}, rejected its input"
        else:
            prefix = "after " + ", ".join(p.spec() for p in passes[: i + 1])
            lowered = isinstance(passes[i], LoweredPass)
            note = (f"{self._where(i)}, produced "
                    + ("invalid programs" if lowered else "an invalid schedule")
                    + (" from valid ones" if lowered else " from a valid one" if self.verify_each
                       else ""))
        return _prefixed(e, prefix, Note(note, span), passes[i])


def _prefixed(e: PipeirError, prefix: str, note: Note | None = None,
              p: PassBase | None = None) -> PipeirError:
    """`e` with its first message prefixed and a note added; same class and exit code. A
    plugin's own failure says where it was raised and which pass ran it already."""
    if isinstance(e, UserCodeError):
        return e
    first, *rest = e.diagnostics
    msg = first.message
    if p is not None:  # the pass named itself; the prefix names it already
        for own in (f"{p.spec()}: ", f"{p.name}: "):
            msg = msg.removeprefix(own)
    notes = first.notes + ((note,) if note is not None else ())
    diag = Diagnostic(f"{prefix}: {msg}", first.span, notes)
    if isinstance(e, VerifyError):
        return VerifyError([diag, *rest], e.check)
    if isinstance(e, UsageError) and not rest:
        return UsageError(diag.message, diag.span, diag.notes)
    return PipeirError([diag, *rest], e.exit_code)


def _user_code(p: PassBase, where: str) -> contextlib.AbstractContextManager[None]:
    """A plugin's `run` is user code (`pipeir.usercode`): what it raises is one line naming
    its file and line, and its prints go to stderr; a built-in pass that raises is a pipeir
    bug and keeps its traceback."""
    if type(p).__module__.startswith("pipeir."):
        # NOTE: the built-in passes allocate objects per op or instruction and make no
        # cycles; collecting while they run walks the whole schedule again and again (two
        # thirds of `overlap` on a 65k-op program, pipeir._gc)
        return paused_gc()
    return contained(f"pass '{p.name}'", f"running {where}")


def _reshaped(before: Schedule, after: Schedule) -> str | None:
    """What a pass changed of the pipeline's shape, which the command that runs it (ranks,
    the batch's micro-batches, the step's rounds) and the costs it planned under fix."""
    a, b = before.config, after.config
    for what, old, new in (("the ranks", a.ranks, b.ranks),
                           ("the micro-batches", a.microbatches, b.microbatches),
                           ("the accumulation rounds", a.accumulate, b.accumulate)):
        if old != new:
            return f"{what} from {old} to {new}"
    return None


def _owner(p: object, name: str) -> type:
    """The class in `p`'s MRO that defines `name`."""
    return next(c for c in type(p).__mro__ if name in vars(c))
