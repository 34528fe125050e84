"""pipeirc opt: run a pass pipeline over a schedule and print the result in canonical form
(like mlir-opt), so every pass can be inspected, diffed and re-checked."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeir import driver
from pipeir.cli.common import add_schedule_args, emit_schedule, load_with_costs, show
from pipeir.cli.simulate import add_costs_arg
from pipeir.diagnostics import UsageError
from pipeir.files import resolve_output, write_atomic
from pipeir.printer import print_schedule

ORDER = 70
NAME = "opt"
HELP = "transform a schedule with a pass pipeline, e.g. --passes 'interleave{v=2},verify'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    p.add_argument("--passes", required=True, metavar="SPEC",
                   help="the pipeline: pass names with options, comma-separated, e.g. "
                        "'interleave{v=2},split-backward{mode=h2},verify' (see `pipeirc passes`)")
    add_costs_arg(p)
    p.add_argument("-o", "--output", metavar="OUT", help="write to OUT instead of stdout")
    p.add_argument("--pass-plugin", action="append", default=[], metavar="MODULE:CLASS",
                   help="load a pass from a module or a .py file (repeatable)")
    p.add_argument("--no-verify-each", dest="verify_each", action="store_false",
                   help="do not verify the input and the result of every pass")
    p.add_argument("--print-after", action="append", default=[], metavar="NAME",
                   help="print the schedule after each pass called NAME (or 'all') to stderr")
    p.add_argument("--dump-dir", metavar="DIR",
                   help="write 00-input.sched, 01-<pass>.sched, ... into DIR")
    p.add_argument("--time-passes", action="store_true",
                   help="print each pass's run and verify time to stderr")


def run(args: argparse.Namespace) -> int:
    from pipeir.passes import DumpDir, Instrument, PrintAfter, TimePasses, load_plugin
    from pipeir.passes.context import printed_costs

    extra = {}
    for spec in args.pass_plugin:
        cls = load_plugin(spec)
        extra[cls.name] = cls
    planned = driver.plan_pipeline(args.passes, extra=extra, required=True)
    show(planned.warnings)
    pipeline = planned.pipeline
    names = {p.name for p in pipeline.passes}
    wanted = {n.strip() for text in args.print_after for n in text.split(",")}
    if "" in wanted:  # (`--print-after ''` printed nothing and said nothing)
        raise UsageError("--print-after: an empty pass name; give NAME[,NAME...] or all")
    unknown = sorted(wanted - names - {"all"})
    if unknown:
        raise UsageError(f"--print-after {unknown[0]}: the pipeline has no pass called that "
                         f"(it runs {', '.join(sorted(names))}; or use 'all')")
    loaded = load_with_costs(args)
    elab = loaded.elaborated
    if args.output is not None:  # before the passes run, not after them (after the input
        resolve_output(args.output, "-o")  # is read: it must not be the output)
        if args.dump_dir is not None:  # (the dump's files, or its directory, in its place)
            target, dump = Path(args.output).resolve(), Path(args.dump_dir).resolve()
            if target == dump or dump in target.parents:
                raise UsageError(f"-o {args.output}: is in --dump-dir {args.dump_dir}, where "
                                 f"the dump writes its files: write it somewhere else")
    show(driver.costless(pipeline.passes, elab.costs))
    instruments: list[Instrument] = []
    if wanted:
        instruments.append(PrintAfter(wanted, sys.stderr))
    settings: dict[str, object] = {k: v for k, (v, _) in elab.costs.items()}
    if args.dump_dir is not None:
        instruments.append(DumpDir(args.dump_dir, write_atomic, settings))
    if args.time_passes:
        instruments.append(TimePasses(sys.stderr))
    done = driver.optimize(elab.schedule, pipeline, loaded.costs, comm="overlapped",
                           verify_each=args.verify_each, instruments=instruments)
    out = done.schedule
    text = print_schedule(out, printed_costs(done.context, settings,
                                             elab.schedule.config.stages, out.config.stages))
    emit_schedule(text, args.output)
    return 0
