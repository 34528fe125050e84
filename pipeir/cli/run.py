"""pipeirc run: compile a schedule and train a model with it on local processes, then print
the measured bubble per rank beside the simulator's prediction."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from pipeir.argtypes import positive_float, timeout_seconds
from pipeir.cli.common import add_device_arg, add_schedule_args, device_env
from pipeir.cli.compile import add_backend_args, compile_args
from pipeir.diagnostics import EXIT_OK, UsageError
from pipeir.files import resolve_output, write_atomic
from pipeir.passes import Compiled
from pipeir.runtime import forkserver
from pipeir.runtime.job import KEEP, Job, Start
from pipeir.runtime.milestones import mark

if TYPE_CHECKING:
    from pipeir.passes.reorder import StepPlanner
    from pipeir.runtime.launch import RunResult

ORDER = 100
NAME = "run"
HELP = "compile a schedule and train a model with it on P local processes (gloo/nccl)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_schedule_args(p)
    add_backend_args(p)
    p.add_argument("--model", metavar="M",
                   help="mlp (default), transformer, heavy-lm, package.module:function or "
                        "file.py[:function]; MODEL@POINT,... cuts a model that can be cut "
                        "at named points there")
    p.add_argument("--plan", metavar="PLAN",
                   help="run a plan file from `pipeirc plan` (its split and schedule) instead "
                        "of FILE; --model defaults to the planned model")
    p.add_argument("--steps", type=int, default=10, metavar="N", help="optimizer steps")
    p.add_argument("--nproc", type=int, metavar="P",
                   help="processes to start (default and only accepted value: the ranks "
                        "times --dp)")
    p.add_argument("--timeout", type=timeout_seconds, default=60.0, metavar="S",
                   help="process-group timeout in seconds; a run stuck this long is stopped")
    add_device_arg(p, "the ranks run")
    p.add_argument("--trace", metavar="OUT",
                   help="write the measured timeline of every step (the first one, a warm-up, "
                        "included) as one Chrome trace")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="a NaN or infinite loss only warns (default: it stops the run, naming "
                        "the step and micro-batch)")
    p.add_argument("--reorder", action="store_true",
                   help="re-plan the micro-batch order every step from the micro-batches' "
                        "sizes (variable-length data; see `reorder` in `pipeirc passes`); "
                        "--costs gives how cost grows with size (default: linear)")
    p.add_argument("--check", action="store_true",
                   help="also train single-process on the same data and report per stage the "
                        "largest relative difference of parameters and gradients beyond "
                        "the rounding noise of a second reference summed in reverse "
                        "micro-batch order; exit 1 beyond --tolerance")
    p.add_argument("--tolerance", type=positive_float, metavar="T",
                   help="for --check (default 1e-5, 2e-2 under autocast)")
    p.add_argument("--metrics", metavar="FILE",
                   help="write per-step metrics (loss, samples/s, tokens/s, lr, grad norm) "
                        "as JSON lines")
    p.add_argument("--save", metavar="DIR", help="checkpoint per stage into DIR (atomically)")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="with --save: every N steps as well as after the last")
    p.add_argument("--keep", type=int, metavar="N",
                   help="with --save: keep the newest N checkpoints, deleting older ones "
                        "(default 2; 0 keeps all)")
    p.add_argument("--resume", metavar="DIR",
                   help="continue from the newest checkpoint in DIR (any schedule or rank "
                        "count with the same stages); --steps counts from step 0")


def run(args: argparse.Namespace) -> int:
    """Train, holding the --save directory's lock throughout (one writer per directory;
    under torchrun, global rank 0's process holds it)."""
    from pipeir.runtime.savelock import holding

    if args.tolerance is not None and not args.check:  # (else a bound nothing is held to)
        raise UsageError("--tolerance goes with --check")
    locks = args.save is not None and os.environ.get("RANK", "0") == "0"
    with device_env(args):  # (the ranks, and torchrun's rank in this process, read it)
        if forkserver.under_torchrun():  # (this process is a rank: torch is imported anyway)
            from pipeir.runtime.torchrun import check_device

            check_device()  # before the save directory's lock, before any rank work
        with holding(args.save if locks else None) as held:
            if held is not None and held.note:
                print(f"note: {held.note}", file=sys.stderr)
            code = _train(args)
    if code == EXIT_OK and forkserver.under_torchrun():  # a rank whose work is done
        from pipeir.runtime.torchrun import end_rank

        end_rank(code)
    return code


def _train(args: argparse.Namespace) -> int:
    if args.steps < 1:
        raise UsageError("--steps must be at least 1")
    mark("launcher: ready")
    torchrun = forkserver.under_torchrun()
    # the ranks' fork server imports torch while this process compiles (`pipeir.cli.main`
    # started it already)
    fork = not torchrun and forkserver.prestart()
    if args.plan is not None:
        _use_plan(args, check_points=not fork)
    elif args.model is None:
        args.model = "mlp"
    from pipeir.models.refs import check_name

    check_name(args.model)  # a mistyped built-in, before anything waits for torch
    build = compile_args(args)
    mark("launcher: compiled")
    compiled, dp = build.compiled, build.dp
    schedule, lowered = compiled.schedule, compiled.lowered
    world = lowered.ranks * dp
    if args.nproc is not None and args.nproc != world:
        fits = args.nproc > 0 and args.nproc % dp == 0  # ranks that would make it fit
        raise UsageError(f"--nproc {args.nproc}: the schedule runs on {lowered.ranks} ranks"
                         + (f" x {dp} replicas" if dp > 1 else "")
                         + f"; use --nproc {world}"
                         + (f" or --set ranks={args.nproc // dp}" if fits else ""))
    from pipeir.backend.codegen import rank_source

    _check_outputs(args)  # before the model check, so that a bad path fails at once
    # bad --model values fail here, before any rank starts
    start = _preflight(args, compiled, dp, fork=fork, placed=not torchrun)
    _check_outputs(args)  # again: nor may they be the model's file, read just now
    sources = tuple(rank_source(lowered, r) for r in range(lowered.ranks))
    job = Job(lowered, sources, args.model, args.steps, plan=_planner(compiled, args),
              collect=args.check, save=args.save, save_every=args.save_every,
              resume=args.resume, dp=dp, allow_nonfinite=args.allow_nonfinite,
              keep=KEEP if args.keep is None else args.keep, layouts=start.layouts)
    if torchrun:  # each node's processes: torchrun placed them, pipeir cannot count them
        return _under_torchrun(job, args, dp)
    from pipeir.runtime.launch import StepReport, launch
    from pipeir.runtime.metrics import MetricsFile, describe, metrics

    c = schedule.config
    print(f"training {args.model} with {schedule.name}: {c.ranks} ranks, {c.stages} stages, "
          f"{c.microbatches} micro-batches x {c.accumulate} round(s)"
          f"{', overlap' if lowered.overlap else ''}; {args.steps} steps"
          + (f"; x {dp} data-parallel replicas ({world} processes, rank = pp x "
             f"{dp} + dp)" if dp > 1 else ""), flush=True)

    if start.checkpoint is not None:
        print(f"resumed from {start.checkpoint} at step {start.step}", flush=True)
    live = sys.stdout.isatty()  # a terminal: one progress line, rewritten in place
    pending = [False]  # a progress line without its newline is on the terminal

    def note(text: str) -> None:  # "saved DIR/step-N (...)", below the progress line
        if pending[0]:
            sys.stdout.write("\n")
            pending[0] = False
        print(text, flush=True)

    log = MetricsFile(args.metrics)

    def progress(rep: StepReport) -> None:
        loss = "-" if rep.loss is None else format(rep.loss, ".5f")
        m = metrics(rep)
        log.write(m)
        line = (f"step {rep.step + 1:>4}/{args.steps}  loss {loss}  {rep.time * 1e3:8.1f} ms  "
                f"{describe(m)}").rstrip()
        if live:
            sys.stdout.write(f"\r{line}\x1b[K")
            sys.stdout.flush()
            pending[0] = True
        else:
            print(line, flush=True)

    try:
        result = launch([job], world, timeout_s=args.timeout, on_step=progress, on_note=note)
    finally:
        log.close()
        if pending[0]:  # keep the last step's line (and any error below it)
            sys.stdout.write("\n")
            sys.stdout.flush()
    _report(compiled, result, args, dp)
    if args.check:
        from pipeir.models import resolve
        from pipeir.runtime.compare import check

        check(resolve(args.model), job, result, args.tolerance)
    return EXIT_OK


def _check_outputs(args: argparse.Namespace) -> None:
    """The outputs may be written (and are not what the run reads)."""
    if args.trace is not None:
        resolve_output(args.trace, "--trace")
    if args.metrics is not None:  # streamed: never a FIFO (open would block), /proc, ...
        resolve_output(args.metrics, "--metrics")
        if args.trace is not None and os.path.realpath(args.trace) == \
                os.path.realpath(args.metrics):
            raise UsageError(f"--trace and --metrics both name {args.metrics}; the trace "
                             "would replace the metrics: give two files")


def _preflight(args: argparse.Namespace, compiled: Compiled, dp: int, *, fork: bool,
               placed: bool) -> Start:
    """The model and checkpoint checks (`pipeir.runtime.preflight`): in a process forked
    from the ranks' fork server when there is one (`fork`; this process then never imports
    torch), else here. `placed`: the ranks run on this machine (not under torchrun)."""
    lowered = compiled.lowered
    what = (args.model, lowered.stages, lowered.microbatches * lowered.accumulate, args.steps)
    flags = {"save": args.save, "save_every": args.save_every, "resume": args.resume,
             "keep": args.keep, "placement": lowered.placement if placed else None, "dp": dp}
    if fork:
        from pipeir.runtime import forked  # the launcher: only `pipeirc run` needs it

        start: Start = forked.call(f"the check of --model {args.model}",
                                   "pipeir.runtime.preflight:check_model", *what, **flags)
    else:
        from pipeir.runtime.preflight import check_model  # imports torch: see the docstring

        start = check_model(*what, **flags)
    mark("launcher: preflight done")
    return start


def _use_plan(args: argparse.Namespace, check_points: bool) -> None:
    """Point `args` at the plan's schedule and its model cut at the planned points. A model
    that cannot be cut at named points, or not at these, is refused by the model check
    (`MODEL@POINT,...` resolves only where it can be cut there): in the forked preflight, so
    that the launcher imports no torch, or here first (`check_points`) where the launcher
    checks the model itself anyway."""
    from pipeir.plan import planfile

    if args.files or args.schedule is not None:
        raise UsageError("give either --plan or a schedule (FILE or --schedule), not both")
    plan = planfile.read(args.plan)
    model = args.model if args.model is not None else plan.model
    if "@" in model:
        raise UsageError(f"--model {model}: with --plan, name the model without split "
                         "points (the plan gives them)")
    if check_points:
        from pipeir.models.refs import resolve_splittable

        resolve_splittable(model).at(plan.points)
    args.model = f"{model}@{','.join(plan.points)}"
    args.files = [plan.source()]
    if plan.comm == "blocking" and args.passes is None and not args.overlap and \
            args.max_posted is None:
        args.blocking = True  # the communication the plan was simulated with


def _planner(compiled: Compiled, args: argparse.Namespace) -> StepPlanner | None:
    """The per-step micro-batch planner for --reorder, planning on the schedule that runs
    (after the passes) under the cost file's shape of cost by length, or None."""
    if not args.reorder:
        return None
    from pipeir.passes.reorder import StepPlanner
    from pipeir.sim.cost_files import read_cost_file

    if compiled.schedule.config.accumulate != 1:
        raise UsageError("--reorder plans one round of micro-batches; use accumulate = 1")
    settings = {k: v for k, (v, _) in read_cost_file(args.costs).items()} if args.costs else {}
    planner = StepPlanner.of(compiled.schedule, settings, compiled.context.comm)
    planner.order([1.0] * planner.microbatches)  # bad cost settings fail here, not in a rank
    return planner


def _report(compiled: Compiled, result: RunResult, args: argparse.Namespace, dp: int) -> None:
    from pipeir.runtime.measure import measured_result, run_report, steps_trace

    lowered, ranks = compiled.lowered, compiled.lowered.ranks
    every = {s: {g: result.times[(0, g, s)] for g in range(ranks * dp)}
             for (_, s) in result.steps}
    reduced = {s: {g: result.reduced.get((0, g, s), []) for g in range(ranks * dp)}
               for (_, s) in result.steps}
    rep = run_report(lowered, compiled.schedule, every,
                     {s: st.time for (_, s), st in result.steps.items()}, dp, reduced)
    # with data parallelism: replica 0's pipeline (global rank = pp rank x dp)
    times = {s: {r: t[r * dp] for r in range(ranks)} for s, t in every.items()}
    predicted, free = rep.predicted, rep.free
    kinds = set(result.devices.values())
    where = {frozenset({"cuda"}): " on CUDA (nccl)", frozenset({"cpu"}): " on CPU (gloo)"}.get(
        frozenset(kinds), "")
    print(f"\nmedian step time {rep.step_time * 1e3:.1f} ms over {len(rep.measured)} step(s)"
          f"{where}; simulated {predicted.makespan * 1e3:.1f} ms")
    print(f"bubble per rank: measured (median over steps) vs simulated with the measured op "
          f"times per stage and kind, and\n{rep.latency * 1e3:.3f} ms per transfer "
          f"({predicted.comm} communication) or free communication")
    print(f"{'rank':>6} {'measured':>9} {'simulated':>10} {'free comm':>10}")
    for r in range(ranks):
        print(f"{r:>6} {rep.rank_bubble(r):>9.1%} {predicted.idle[r] / predicted.makespan:>10.1%} "
              f"{free.idle[r] / free.makespan:>10.1%}")
    print(f"{'all':>6} {rep.bubble:>9.1%} {predicted.bubble:>10.1%} {free.bubble:>10.1%}")
    if predicted.has_reductions or any(m.has_reductions for m in rep.measured):
        exposed = sorted(m.exposed_reduction for m in rep.measured)[len(rep.measured) // 2]
        print(f"gradient all-reduce ({dp} replicas): {exposed * 1e3:.1f} ms of the step "
              f"waits for it (median), simulated {predicted.exposed_reduction * 1e3:.1f} ms "
              f"with the measured all-reduce times ({predicted.hidden_reduction:.0%} hidden)")
    _report_memory(compiled, result, ranks, dp)
    cores = result.compute_slots()
    if ranks > cores:
        print(f"note: {ranks} ranks share {cores} CPU core(s), so ranks that compute at the "
              "same time slow each other down;\nthe simulator gives each rank its own device, "
              "so expect the measured bubble above the simulated one")
    if args.trace is not None:
        expanded = predicted.schedule
        t_zero = min(t0 for s in rep.steps for r in range(ranks) for _, t0, _ in times[s][r])
        trace = steps_trace([measured_result(lowered, expanded, times[s], t_zero)
                             for s in rep.steps])
        write_atomic(args.trace, json.dumps(trace), "--trace")
        print(f"wrote {args.trace} (measured timeline of all {len(rep.steps)} steps; open it in "
              "https://ui.perfetto.dev)")


def _report_memory(compiled: Compiled, result: RunResult, ranks: int, dp: int) -> None:
    """Measured peak saved-activation bytes per rank next to the simulated peak (the
    verifier's count with each stage's bytes as measured in this run: what a forward saved,
    and what W still needed after I), and, where backwards ran split, the peak the
    whole-release model (everything held until W) would predict."""
    from pipeir.runtime.measure import predicted_saved_bytes, simulated_saved_bytes

    saved = {s: b for (j, s), b in result.saved_per_stage.items() if j == 0}
    kept = {s: b for (j, s), b in result.kept_per_stage.items() if j == 0}
    for_w = {s: b for (j, s), b in result.w_per_stage.items() if j == 0}
    if not saved:
        return
    simulated = simulated_saved_bytes(compiled.schedule, saved, kept, for_w)
    whole = simulated_saved_bytes(compiled.schedule, saved, kept) if for_w else None
    costs = compiled.context.costs
    given = predicted_saved_bytes(compiled.schedule, costs.stage_memory) \
        if costs.knows_memory else None
    print("peak saved activations (bytes): measured (the most in any step) vs simulated with "
          "the measured bytes per stage" + (" (I frees what W does not need; whole: held "
                                            "until W)" if whole else "")
          + ("; costs: simulated with the cost file's" if given else ""))
    for r in range(ranks):
        got = max(b for (j, g, _), b in result.saved_peak.items() if j == 0 and g == r * dp)
        line = f"  rank {r}: measured {got:,} simulated {simulated[r]:,.0f}"
        if whole is not None:
            line += f" whole {whole[r]:,.0f}"
        if given is not None:
            line += f" costs {given[r]:,.0f} ({_off(given[r], got)})"
        print(line)


def _off(predicted: float, measured: float) -> str:
    """How far a prediction is from a measurement, as a signed percentage of it."""
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"


def _under_torchrun(job: Job, args: argparse.Namespace, dp: int) -> int:
    """Started by torchrun: this process is one rank (of P x D); the last stage's rank
    prints."""
    from pipeir.runtime.torchrun import run_env

    return run_env(job, args.timeout, dp)
