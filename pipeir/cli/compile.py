"""pipeirc compile: lower a schedule to per-rank programs, prove them deadlock-free, and
write readable Python (one file per rank, main.py for torchrun, lowered.json)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from pipeir import driver
from pipeir._gc import paused_gc
from pipeir.cli.common import add_schedule_args, load_with_costs, show
from pipeir.cli.simulate import add_costs_arg
from pipeir.diagnostics import EXIT_OK, UsageError
from pipeir.files import check_tree, write_tree
from pipeir.progress import Progress

ORDER = 90
NAME = "compile"
HELP = "lower a schedule to per-rank torch.distributed programs (Python) for torchrun"

#: Written into `-o DIR` with the names of the generated files: it tells a directory compile
#: may write (and whose stale rank files it may remove) from a user's own.
MARKER = ".pipeir-compile"


def add_backend_args(p: argparse.ArgumentParser) -> None:
    """--passes / --overlap / --blocking / --max-posted / --costs, shared with `pipeirc run`."""
    p.add_argument("--passes", metavar="SPEC",
                   help="passes to apply, e.g. 'split-backward,overlap{max_posted=2}'; the "
                        "overlap pass is appended unless --blocking")
    comm = p.add_mutually_exclusive_group()
    comm.add_argument("--overlap", action="store_true",
                      help="asynchronous communication (the default: the overlap pass)")
    comm.add_argument("--blocking", action="store_true",
                      help="blocking communication: every send and receive waited for where "
                           "it is (no overlap pass)")
    p.add_argument("--max-posted", type=int, metavar="K",
                   help="with overlap: at most K receives posted ahead (0 = no bound)")
    p.add_argument("--dp", type=int, metavar="D",
                   help="data-parallel replicas of the pipeline (P x D processes; default: "
                        "the costs' dp, else 1); with D > 1 a schedule without gradient "
                        "reductions gets the dp-reduce pass")
    add_costs_arg(p)


def compile_args(args: argparse.Namespace, progress: Callable[[str], None] | None = None
                 ) -> driver.Build:
    """The schedule the command line names, through its passes, lowered and proved, under its
    costs and data-parallel replicas (`pipeir.driver`); `progress` hears of each phase
    (`pipeir.progress`). Warnings are printed as the driver gives them."""
    planned = driver.plan_pipeline(args.passes, overlap=not args.blocking,
                                   max_posted=args.max_posted)
    show(planned.warnings)
    loaded = load_with_costs(args)
    show(driver.costless(planned.pipeline.passes, loaded.elaborated.costs))
    return driver.compile_schedule(loaded.schedule, planned.pipeline, loaded.costs,
                                   dp=args.dp, progress=progress)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    add_backend_args(p)
    p.add_argument("-o", "--output", metavar="DIR",
                   help="write rank<r>.py, main.py and lowered.json into DIR (new, empty, "
                        "or written by an earlier compile)")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty -o DIR that pipeirc compile did not write")
    p.add_argument("--emit", choices=("lowered", "json", "python", "unrolled"),
                   help="print the lowered programs (text or JSON), rank 0's Python source "
                        "(the table interpreter written to rank0.py), or rank 0's program "
                        "unrolled as straight-line Python (one call per instruction)")


def run(args: argparse.Namespace) -> int:
    if args.output == "":
        raise UsageError("-o: empty path")
    if not args.output and not args.emit:
        raise UsageError("nothing to do: give -o DIR and/or --emit lowered|json|python")
    if args.force and not args.output:
        raise UsageError("--force goes with -o DIR (it lets a compile replace DIR's files)")
    out = Path(args.output) if args.output else None
    if out is not None:  # refuse before the work, not after
        if out.exists() and not out.is_dir():
            raise UsageError(f"-o {out}: exists and is not a directory")
        if not out.parent.is_dir():
            raise UsageError(f"-o {out}: directory {out.parent} does not exist")
        check_tree(out, MARKER, flag="-o", force=args.force)
    # NOTE (the collector): the phases that build objects by the million (elaboration,
    # lowering, the proof, writing) pause the cyclic collector, and none of them makes
    # cycles; between them, and once more after the work, it walked every object made while
    # paused (1.7 s of an 18 s compile at p = 64) and could free none. One command is one
    # pipeline, so the collector waits for its end: `_compile` returns, letting its objects
    # go, before the collector runs again (pipeir._gc). Cycles a user's pass makes (built-in
    # passes already run paused: `PassManager`) wait for that end too: they are bounded by
    # one command, not kept across many.
    with paused_gc():
        _compile(args, out)
    return EXIT_OK


def _compile(args: argparse.Namespace, out: Path | None) -> None:
    from pipeir.backend.codegen import generate, rank_source, unrolled_source
    from pipeir.backend.commcheck import rules_id
    from pipeir.backend.program_io import dumps, format_lowered

    with Progress("compile") as progress:
        progress("reading the schedule")
        build = compile_args(args, progress)
        lowered = build.compiled.lowered
        if out is not None:
            progress(f"generating {lowered.ranks} rank programs")
            files = generate(lowered, proof=rules_id())  # the driver proved it
    if out is not None:
        write_tree(out, files, MARKER, flag="-o", force=args.force)
        if not args.emit:
            print(f"wrote {out}/: {', '.join(f'rank{r}.py' for r in range(lowered.ranks))}, "
                  f"main.py, lowered.json; run with: torchrun --nproc-per-node "
                  f"{lowered.ranks * build.dp} {out}/main.py --model mlp"
                  + (f" (pipeline x {build.dp} data-parallel replicas)" if build.dp > 1
                     else ""))
    if args.emit == "lowered":
        sys.stdout.write(format_lowered(lowered))
    elif args.emit == "json":
        sys.stdout.write(dumps(lowered))
    elif args.emit == "python":
        sys.stdout.write(rank_source(lowered, 0))
    elif args.emit == "unrolled":
        sys.stdout.write(unrolled_source(lowered, 0))
