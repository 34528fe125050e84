"""pipeirc synth: find the fastest per-rank order of ops for a cost file and a memory budget
(OR-Tools CP-SAT, warm-started from tune), with a proven lower bound; write it as .sched."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

from pipeir import driver, memunit
from pipeir.argtypes import positive_float, positive_int
from pipeir.cli.common import activations_or_bytes, byte_size, show
from pipeir.diagnostics import Span, UsageError
from pipeir.files import resolve_output, write_atomic

ORDER = 115
NAME = "synth"
HELP = ("synthesise the fastest schedule for a cost file and a memory budget, with a proven "
        "lower bound (writes .sched)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", required=True, metavar="FILE",
                   help="JSON or TOML cost file (what `pipeirc profile` writes)")
    p.add_argument("--ranks", type=positive_int, metavar="P",
                   help="pipeline ranks (default: the stages the cost file describes)")
    p.add_argument("--microbatches", type=positive_int, required=True, metavar="M",
                   help="micro-batches per step")
    p.add_argument("--v", type=positive_int, default=None, metavar="V",
                   help="chunks per rank: each stage is cut into V, as tune does (default: "
                        "search 1, 2, 4 while small enough to solve exactly, and the V of "
                        "tune's best schedule)")
    p.add_argument("--placement", choices=("loop", "vshape", "search"), default="search",
                   help="where chunks live when V > 1; search tries both (default)")
    mem = p.add_mutually_exclusive_group()
    mem.add_argument("--memory-limit", type=activations_or_bytes, metavar="K",
                     help=f"{memunit.HELP} (default: 1F1B's memory at every V, P x V); or "
                          f"bytes with a unit, as --memory-bytes")
    mem.add_argument("--memory-bytes", type=byte_size, metavar="B",
                     help="most activation bytes a rank may hold (needs memory_bytes costs)")
    back = p.add_mutually_exclusive_group()
    back.add_argument("--backward", choices=("whole", "split", "search"), default="search",
                      help="order whole backwards (B), split ones (I and W separately: "
                           "zero-bubble schedules), or search both and keep the faster "
                           "(default: %(default)s)")
    back.add_argument("--split-backward", action="store_const", dest="backward",
                      const="split", help="the same as --backward split")
    p.add_argument("--objective", choices=("makespan", "steady"), default="makespan",
                   help="what to minimise: makespan, one step on its own (what a step "
                        "costs when the optimizer step is synchronised across ranks, as "
                        "pipeirc run does); steady, the time per step with steps back to "
                        "back, each rank starting the next step once it has finished this "
                        "one (the optimizer stepped per stage, e.g. the Zero Bubble paper's "
                        "post-validation) (default: %(default)s)")
    p.add_argument("--comm", choices=("overlapped", "blocking"), default="overlapped",
                   help="communication model (default: %(default)s)")
    p.add_argument("--time-limit", type=positive_float, default=60.0, metavar="S",
                   help="seconds the search may take (default 60)")
    p.add_argument("--work-limit", type=positive_float, metavar="D",
                   help="also stop each solver phase after D deterministic seconds of work: "
                        "with one worker, and a --time-limit long enough that the work limit, "
                        "not the clock, ends every phase, the result no longer depends on "
                        "machine load")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="solver seed (default 0)")
    p.add_argument("--workers", type=positive_int, default=2, metavar="N",
                   help="solver threads (default 2; 1 is deterministic)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the schedule to OUT")


def run(args: argparse.Namespace) -> int:
    from pipeir.printer import print_schedule
    from pipeir.search.interrupt import interruptible
    from pipeir.search.synth import BudgetError, synth
    from pipeir.sim.cost_files import read_cost_file
    from pipeir.sim.steady import steady_state
    from pipeir.verify import verify

    # a budget in bytes given either way (as check, tune and plan take one), named as given
    bytes_flag = "--memory-bytes"
    if args.memory_limit is not None:
        given: memunit.MemoryLimit = args.memory_limit
        if given.in_bytes:
            bytes_flag = "--memory-limit"
        args.memory_limit, args.memory_bytes = given.count, given.bytes
    settings: dict[str, tuple[Any, Span | None]] = read_cost_file(args.costs)
    if args.output is not None:  # before the search (after the read: not over the cost file)
        resolve_output(args.output, "-o")
    found = driver.search_costs(args.costs, settings, args.ranks)
    show(found.warnings)
    costs, ranks = found.costs, found.ranks
    _check(args, costs, ranks, settings)
    assert ranks is not None
    if args.memory_bytes is not None and not costs.knows_memory:
        raise UsageError(f"{bytes_flag} {_exact(args.memory_bytes)} needs activation sizes in "
                         f"the cost file (memory_bytes or stage.S.memory_bytes)")
    limit: memunit.Budget = args.memory_limit if args.memory_limit is not None \
        else (None if args.memory_bytes is not None else memunit.ONE_F_ONE_B)
    progress = _Line(costs.unit) if sys.stderr.isatty() else None
    try:
        # Ctrl-C: stop at once, write nothing, exit 130 (`pipeir.search.interrupt`)
        with interruptible(progress.done if progress is not None else None):
            result = synth(costs, ranks, args.microbatches, v=args.v,
                           placement=args.placement,
                           split={"whole": False, "split": True}.get(args.backward),
                           comm=args.comm, objective=args.objective,
                           memory_limit=limit, memory_bytes=args.memory_bytes,
                           time_limit=args.time_limit, workers=args.workers, seed=args.seed,
                           work_limit=args.work_limit, progress=progress)
    except BudgetError as e:  # `synth` gives e.least in the unit asked for
        if args.memory_bytes is not None:
            raise UsageError(f"{bytes_flag} {_exact(args.memory_bytes)}: no schedule fits; the "
                             f"smallest feasible limit is {bytes_flag} {_at_least(e.least)}"
                             ) from None
        raise UsageError(f"{memunit.describe(limit)}: no schedule fits; the smallest feasible "
                         f"limit is --memory-limit {_at_least(e.least)} ({memunit.UNIT})"
                         ) from None
    finally:
        if progress is not None:
            progress.done()
    unit = f" {costs.unit}" if costs.unit else ""
    c = result.problem.config
    budget = f"{bytes_flag} {_exact(args.memory_bytes)}" if args.memory_bytes is not None \
        else memunit.describe(limit)
    print(f"synth: {c.ranks} rank{'s' if c.ranks != 1 else ''}, {c.microbatches} "
          f"micro-batch{'es' if c.microbatches != 1 else ''}, v={c.stages // c.ranks} "
          f"({c.placement_name or 'explicit'} placement), "
          f"{'I + W' if result.problem.split else 'B'} backwards, {args.comm} communication, "
          f"{budget}" + ("; minimising the step with steps back to back"
                         if args.objective == "steady" else ""))
    print(f"warm start: {result.warm.label}: step {result.warm.step:.6g}{unit}")
    print(best_line(result.step, result.warm.step, result.method, unit))
    print(f"lower bound: {result.bound:.6g}{unit}; gap {result.gap:.1%}"
          f"{_optimal(result)}; {result.wall:.1f} s")
    st = steady_state(result.schedule, result.problem.costs, args.comm)
    print(f"the schedule: makespan {st.makespan:.6g}{unit}, {st.step:.6g}{unit} per step "
          f"back to back (bubble {st.bubble_at(st.makespan):.1%} of the makespan, {st.bubble:.1%} "
          "back to back)")
    if len(result.shapes) > 1 or result.unsearched:
        print(f"shapes searched: {', '.join(result.shapes)}" + (
            f"; not reached within --time-limit {args.time_limit:g}: "
            f"{', '.join(result.unsearched)} (the bound does not cover them)"
            if result.unsearched else ""))
    if result.library_cut:
        print(f"note: --time-limit {args.time_limit:g} cut tune's library search short, so "
              "tune's best schedule may be missing from the warm starts and synth can end "
              "slower than `pipeirc tune`; a longer limit keeps it at least as fast",
              file=sys.stderr)
    if args.output is not None:
        verify(result.schedule)
        write_atomic(args.output, print_schedule(result.schedule,
                                                 result.problem.costs.settings()), "-o")
        hint = " --comm blocking" if args.comm == "blocking" else ""
        print(f"wrote {args.output} (pipeirc simulate {args.output}{hint})")
    return 0


def best_line(step: float, warm: float, method: str, unit: str) -> str:
    """The "best:" line, one finished sentence: the step, how it compares with the warm start
    and what found it (`method`, as `synthesize` reports it: "the warm start", "exact model",
    "the warm start meets the lower bound", ...)."""
    head = f"best: step {step:.6g}{unit}"
    if warm > 0 and step < warm * (1 - 1e-9):
        return f"{head}, {1 - step / warm:.1%} faster than the warm start (found by: {method})"
    if method.startswith("the warm start"):  # "the warm start" or "... meets the lower bound"
        rest = method.removeprefix("the warm start").removeprefix(", then ").strip()
        if not rest:
            return f"{head}: the warm start; the search found nothing faster"
        if rest.startswith("meets"):
            return f"{head}: the warm start, which {rest}"
        return f"{head}: the warm start; the search ({rest}) found nothing faster"
    return f"{head}: the warm start; the search ({method}) found nothing faster"


def _optimal(result: Any) -> str:
    """What "optimal" covers: the one shape searched, or the shapes searched (never every
    v: more chunks per rank can be faster within the same budget)."""
    if not result.optimal:
        return ""
    if len(result.shapes) == 1 and not result.unsearched:
        return f" (optimal for {result.shapes[0]})"
    return " (optimal in the shapes searched)" if result.shapes else " (optimal)"


def _exact(x: float) -> str:
    """`x` in the fewest digits that give it back (a limit one byte below another must not
    print the same)."""
    return next((t for t in (f"{x:.{d}g}" for d in range(6, 18)) if float(t) == x), repr(x))


def _at_least(x: float) -> str:
    """`x` in the fewest digits that do not round it down: the limit a message suggests must
    itself be feasible (`%g` turns 1234561234 into 1.23456e+09, which is not)."""
    for digits in range(6, 18):
        text = f"{x:.{digits}g}"
        if float(text) >= x:
            return text
    return repr(x)


def _check(args: argparse.Namespace, costs: Any, ranks: int | None,
           settings: dict[str, tuple[Any, Span | None]]) -> None:
    from pipeir.sim.lengths import check_count, split_length_settings

    if ranks is None:
        raise UsageError(f"{args.costs} has no per-stage costs to tell the number of stages; "
                         "give --ranks P")
    if args.v == 1 and args.placement == "vshape":  # (it ran, and said "loop placement")
        raise UsageError("--placement vshape needs --v 2 or more: with one chunk per rank "
                         "every placement is the loop")
    known = driver.infer_ranks(costs)
    if known is not None and known > ranks:
        raise UsageError(f"the costs describe {known} stages (stage.{known - 1}.* is set) but "
                         f"--ranks is {ranks}; synth runs one model stage per rank")
    if costs.dp > 1:
        raise UsageError(f"{args.costs}: dp = {costs.dp}: synth orders one pipeline replica "
                         "and does not model gradient all-reduces; synthesise with dp = 1, "
                         "then add them with `pipeirc opt OUT --passes dp-reduce`")
    _, spec = split_length_settings(settings, where=args.costs)
    if spec is not None:
        check_count(spec, args.microbatches, settings["lengths"][1], args.costs)
    driver.check_mb_costs(costs, args.microbatches)


class _Line:
    """The live one-line progress display on a terminal (stderr)."""

    def __init__(self, unit: str | None):
        self.unit = f" {unit}" if unit else ""
        self.shown = self.closed = False
        self.lock = threading.Lock()  # solver threads report; Ctrl-C's watcher ends the line

    def __call__(self, wall: float, best: float, bound: float) -> None:
        gap = max(0.0, 1 - bound / best) if best > 0 else 0.0
        with self.lock:
            if self.closed:  # a solver still reporting after Ctrl-C ended the line
                return
            self.shown = True  # first: a Ctrl-C during the write still ends the line
            sys.stderr.write(f"\r  {wall:6.1f} s  best {best:.6g}{self.unit}  bound "
                             f"{bound:.6g}{self.unit}  gap {gap:5.1%} ")
            sys.stderr.flush()

    def done(self) -> None:
        with self.lock:
            if self.shown and not self.closed:
                sys.stderr.write("\n")
                sys.stderr.flush()
            self.closed = True

