"""pipeirc run: compile a schedule and train a model with it on local processes, then print
the measured bubble per rank beside the simulator's prediction."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from pipeir.cli.common import add_schedule_args, write_atomic
from pipeir.cli.compile import add_backend_args, compile_args
from pipeir.diagnostics import EXIT_OK, UsageError

ORDER = 100
NAME = "run"
HELP = "compile a schedule and train a model with it on P local processes (gloo/nccl)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    add_backend_args(p)
    p.add_argument("--model", default="mlp", metavar="M",
                   help="mlp, transformer, package.module:function or file.py[:function]")
    p.add_argument("--steps", type=int, default=10, metavar="N", help="optimizer steps")
    p.add_argument("--nproc", type=int, metavar="P",
                   help="processes to start (default and only accepted value: the ranks)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="process-group timeout in seconds; a run stuck this long is stopped")
    p.add_argument("--trace", metavar="OUT",
                   help="write the measured timeline of every step (the first one, a warm-up, "
                        "included) as one Chrome trace")
    p.add_argument("--reorder", action="store_true",
                   help="re-plan the micro-batch order every step from the micro-batches' "
                        "sizes (variable-length data; see `reorder` in `pipeirc passes`)")
    p.add_argument("--costs", metavar="FILE",
                   help="with --reorder: the cost file the plan simulates (its length_cost "
                        "gives how cost grows with size; default: linear)")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise UsageError("--steps must be at least 1")
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    if args.trace:
        parent = Path(args.trace).parent
        if not parent.is_dir():
            raise UsageError(f"--trace {args.trace}: directory {parent} does not exist")
    schedule, lowered = compile_args(args)
    if args.nproc is not None and args.nproc != lowered.ranks:
        raise UsageError(f"--nproc {args.nproc}: the schedule runs on {lowered.ranks} ranks; "
                         f"use --nproc {lowered.ranks} or --set ranks={args.nproc}")
    from pipeir.backend.codegen import rank_source
    from pipeir.models import resolve

    spec = resolve(args.model)  # bad --model values fail here, before any process starts
    _check_batch(spec, args.model, lowered.microbatches * lowered.accumulate)
    from pipeir.runtime.worker import Job

    sources = tuple(rank_source(lowered, r) for r in range(lowered.ranks))
    job = Job(lowered, sources, args.model, args.steps, plan=_planner(schedule, lowered, args))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return _under_torchrun(job, args)
    from pipeir.runtime.launch import StepReport, launch

    c = schedule.config
    print(f"training {args.model} with {schedule.name}: {c.ranks} ranks, {c.stages} stages, "
          f"{c.microbatches} micro-batches x {c.accumulate} round(s)"
          f"{', overlap' if lowered.overlap else ''}; {args.steps} steps", flush=True)

    live = sys.stdout.isatty()  # a terminal: one progress line, rewritten in place
    pending = [False]  # a progress line without its newline is on the terminal

    def progress(rep: StepReport) -> None:
        loss = "-" if rep.loss is None else format(rep.loss, ".5f")
        line = f"step {rep.step + 1:>4}/{args.steps}  loss {loss}  {rep.time * 1e3:8.1f} ms"
        if live:
            sys.stdout.write(f"\r{line}\x1b[K")
            sys.stdout.flush()
            pending[0] = True
        else:
            print(line, flush=True)

    try:
        result = launch([job], lowered.ranks, timeout_s=args.timeout, on_step=progress)
    finally:
        if pending[0]:  # keep the last step's line (and any error below it)
            sys.stdout.write("\n")
            sys.stdout.flush()
    _report(schedule, lowered, result, args)
    return EXIT_OK


def _planner(schedule: object, lowered: object, args: argparse.Namespace) -> object:
    """The per-step micro-batch planner for --reorder (issue 7), or None."""
    if args.costs and not args.reorder:
        raise UsageError("--costs goes with --reorder")
    if not args.reorder:
        return None
    from pipeir.passes.pipeline import parse_pipeline
    from pipeir.passes.reorder import StepPlanner
    from pipeir.sim.costs import read_cost_file

    if schedule.config.accumulate != 1:  # type: ignore[attr-defined]
        raise UsageError("--reorder plans one round of micro-batches; use accumulate = 1")
    if args.passes:  # plan on the schedule that runs
        for p in parse_pipeline(args.passes).by_level("schedule").passes:
            schedule = p.run(schedule)  # type: ignore[arg-type]
    settings = {k: v for k, (v, _) in read_cost_file(args.costs).items()} if args.costs else {}
    comm = "overlapped" if lowered.overlap else "blocking"  # type: ignore[attr-defined]
    planner = StepPlanner.of(schedule, settings, comm)  # type: ignore[arg-type]
    planner.order([1.0] * planner.microbatches)  # bad cost settings fail here, not in a rank
    return planner


def _check_batch(spec: object, model: str, n: int) -> None:
    from pipeir.runtime.worker import split_batch

    try:
        split_batch(spec.batch(0), n)  # type: ignore[attr-defined]
    except ValueError as e:
        raise UsageError(f"--model {model}: {e}") from None
    except Exception as e:
        raise UsageError(f"--model {model}: batch(0) raised {type(e).__name__}: {e}") from None


def _report(schedule: object, lowered: object, result: object, args: argparse.Namespace
            ) -> None:
    from pipeir.runtime.measure import (
        calibrated_prediction,
        expand_rounds,
        measured_result,
        steps_trace,
        transfer_latency,
    )

    steps = sorted(s for (_, s) in result.steps)  # type: ignore[attr-defined]
    keep = steps[1:] if len(steps) > 1 else steps  # the first step warms up
    ranks = lowered.ranks  # type: ignore[attr-defined]
    expanded = expand_rounds(schedule)  # type: ignore[arg-type]
    times = {s: {r: result.times[(0, r, s)] for r in range(ranks)}  # type: ignore[attr-defined]
             for s in steps}
    measured = [measured_result(lowered, expanded, times[s]) for s in keep]  # type: ignore[arg-type]
    latency = transfer_latency(lowered, [times[s] for s in keep])  # type: ignore[arg-type]
    predicted = calibrated_prediction(lowered, measured, latency)  # type: ignore[arg-type]
    free = calibrated_prediction(lowered, measured, 0.0)  # type: ignore[arg-type]
    step_ms = statistics.median(result.steps[(0, s)].time for s in keep) * 1e3  # type: ignore[attr-defined]
    comm = predicted.comm
    print(f"\nmedian step time {step_ms:.1f} ms over {len(keep)} step(s); simulated "
          f"{predicted.makespan * 1e3:.1f} ms")
    print(f"bubble per rank: measured (median over steps) vs simulated with the measured op "
          f"times per stage and kind, and\n{latency * 1e3:.3f} ms per transfer ({comm} "
          f"communication) or free communication")
    print(f"{'rank':>6} {'measured':>9} {'simulated':>10} {'free comm':>10}")
    for r in range(ranks):
        got = statistics.median(m.idle[r] / m.makespan for m in measured)
        print(f"{r:>6} {got:>9.1%} {predicted.idle[r] / predicted.makespan:>10.1%} "
              f"{free.idle[r] / free.makespan:>10.1%}")
    got = statistics.median(m.bubble for m in measured)
    print(f"{'all':>6} {got:>9.1%} {predicted.bubble:>10.1%} {free.bubble:>10.1%}")
    cores = _cores()
    if ranks > cores:
        print(f"note: {ranks} ranks share {cores} CPU core(s), so ranks that compute at the "
              "same time slow each other down;\nthe simulator gives each rank its own device, "
              "so expect the measured bubble above the simulated one")
    if args.trace:
        t_zero = min(t0 for s in steps for r in range(ranks) for _, t0, _ in times[s][r])
        trace = steps_trace([measured_result(lowered, expanded, times[s], t_zero)  # type: ignore[arg-type]
                             for s in steps])
        write_atomic(args.trace, json.dumps(trace))
        print(f"wrote {args.trace} (measured timeline of all {len(steps)} steps; open it in "
              "https://ui.perfetto.dev)")


def _cores() -> int:
    """CPU cores the ranks may run on (a large number with CUDA: one device per rank)."""
    import torch

    if torch.cuda.is_available():
        return 1 << 30
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _under_torchrun(job: object, args: argparse.Namespace) -> int:
    """Started by torchrun: this process is one rank; the last stage's rank prints."""
    from pipeir.runtime.worker import run_rank

    def emit(msg: tuple[object, ...]) -> None:
        if msg[0] == "step" and msg[4] is not None:
            step, loss, t0, t1 = msg[3], msg[4], msg[5], msg[6]
            sys.stdout.write(f"step {step + 1}/{args.steps}  loss {loss:.5f}  "  # type: ignore[operator]
                             f"{(t1 - t0) * 1e3:.1f} ms\n")  # type: ignore[operator]
            sys.stdout.flush()

    run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", [job],  # type: ignore[list-item]
             emit, lambda j, pc: None, args.timeout)
    return EXIT_OK
