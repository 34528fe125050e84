"""pipeirc tune: search library schedules, chunks, micro-batch counts and passes in the
simulator for the fastest step within a memory limit; print the ranking, write the best."""

from __future__ import annotations

import argparse
from typing import Any

from pipeir import driver, memunit
from pipeir.cli.common import activations_or_bytes, positive_ints, show
from pipeir.diagnostics import Span, UsageError
from pipeir.files import resolve_output, write_atomic
from pipeir.progress import Progress

ORDER = 110
NAME = "tune"
HELP = "find the fastest schedule for a cost file (ranked table; writes the best as .sched)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", required=True, metavar="FILE",
                   help="JSON or TOML cost file (what `pipeirc profile` writes)")
    p.add_argument("--ranks", type=int, metavar="P",
                   help="pipeline ranks (default: the stages the cost file describes)")
    p.add_argument("--microbatches", metavar="M[,M2..]",
                   help="micro-batch counts to try; the costs describe a micro-batch of the "
                        "first, the others split the same global batch (default: 2P,4P)")
    p.add_argument("--memory-limit", type=activations_or_bytes, metavar="K",
                   help=f"{memunit.HELP}; {memunit.SPLIT_HELP}; or bytes of saved activations "
                        "with a unit (8GB, "
                        "512MiB, 3e8B; needs memory_bytes in the costs), which compare across "
                        "chunks and micro-batch counts (default: no limit)")
    p.add_argument("--lengths", metavar="L,L,...",
                   help="one sequence length per micro-batch (see `length_cost` in the cost "
                        "file); turns on the reorder pass")
    p.add_argument("--max-v", type=int, default=8, metavar="V",
                   help="largest chunks per rank for interleaving (a power of 2, at most 64; "
                        "default 8)")
    p.add_argument("--comm", choices=("both", "overlapped", "blocking"), default="both",
                   help="overlapped = with the backend's overlap pass (default: both)")
    p.add_argument("--dp", type=int, metavar="D",
                   help="data-parallel replicas of the pipeline (default: the cost file's dp, "
                        "else 1): adds the gradient all-reduces (dp-reduce) to every candidate")
    p.add_argument("--top", type=int, default=None, metavar="N", help="print only N rows")
    p.add_argument("-o", "--output", metavar="OUT", help="write the best schedule to OUT")


def run(args: argparse.Namespace) -> int:
    from pipeir.printer import print_schedule
    from pipeir.search.tune import search, table
    from pipeir.sim.cost_files import read_cost_file
    from pipeir.sim.lengths import check_count, parse_lengths, split_length_settings
    from pipeir.verify import verify

    settings: dict[str, tuple[Any, Span | None]] = read_cost_file(args.costs)
    if args.output is not None:  # before the search (after the read: not over the cost file)
        resolve_output(args.output, "-o")
    if args.lengths:
        settings["lengths"] = (parse_lengths(args.lengths), None)
    _, spec = split_length_settings(settings, where=args.costs)
    found = driver.search_costs(args.costs, settings, args.ranks)
    show(found.warnings)
    costs, ranks = found.costs, found.ranks
    if ranks is None:
        raise UsageError(f"{args.costs} has no per-stage costs to tell the number of stages; "
                         "give --ranks P")
    if args.dp is not None:
        driver.check_replicas(ranks, args.dp)
    if args.top is not None and args.top < 1:
        raise UsageError(f"--top {args.top}: need at least 1")
    if args.microbatches is not None:
        mbs = positive_ints("--microbatches", args.microbatches)
    elif spec is not None:
        mbs = [len(spec.lengths)]
    else:
        mbs = [2 * ranks, 4 * ranks]
    for m in mbs:
        check_count(spec, m)
        driver.check_mb_costs(costs, m)
    comms = ("overlapped", "blocking") if args.comm == "both" else (args.comm,)
    limit: memunit.MemoryLimit | None = args.memory_limit
    with Progress("tune") as progress:
        result = search(costs, ranks, mbs, memory_limit=None if limit is None else limit.count,
                        max_v=args.max_v, comms=comms, dp=args.dp, progress=progress,
                        memory_bytes=None if limit is None else limit.bytes)
    best = result.best
    print(table(result, args.top), end="")
    if result.over_limit and limit is not None:
        print(f"({len(result.over_limit)} candidates over --memory-limit {limit.text} left "
              "out)")
    print(f"best: {best.family}" + (f" v={best.v}" if best.v > 1 else "")
          + f", {best.microbatches} micro-batches" + (f", {best.passes}" if best.passes else "")
          + f", {'overlapped' if best.overlap else 'blocking'} communication: "
          f"step {best.step_time:.6g}{' ' + best.costs.unit if best.costs.unit else ''}"
          + (f" with dp = {best.costs.dp} ({best.exposed_reduction:.6g} of it waiting for "
             "gradient all-reduces)" if best.costs.dp > 1 else ""))
    if args.output is not None:
        verify(best.schedule)
        write_atomic(args.output, print_schedule(best.schedule, best.costs.settings()), "-o")
        hint = "" if best.overlap else \
            " --comm blocking; compile or run it with --blocking to run it so"
        print(f"wrote {args.output} (pipeirc simulate {args.output}{hint})")
    return 0
