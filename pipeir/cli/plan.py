"""pipeirc plan: profile a model piece by piece, choose its cut points and schedule together
under a memory budget, print the plan beside the uniform split with tune's best, and write
the plan file (`run --plan`) and the `.sched`."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from pipeir.argtypes import positive_float, timeout_seconds
from pipeir.cli.common import activations_or_bytes, add_device_arg, device_env
from pipeir.diagnostics import PipeirError, UsageError
from pipeir.files import resolve_output, write_atomic
from pipeir.progress import Progress
from pipeir.runtime import devices

if TYPE_CHECKING:
    import torch

    from pipeir.models.splittable import Splittable
    from pipeir.plan import Choice, LayerCost, Link, Plan
    from pipeir.plan.planfile import PlanFile

ORDER = 107
NAME = "plan"
HELP = ("choose where to cut a model and which schedule to run (profiled per layer, under a "
        "memory budget); writes a plan for `run --plan`")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="M",
                   help="a model that can be cut at named points: transformer, heavy-lm, or "
                        "module:function / file.py:function returning a Splittable")
    p.add_argument("--ranks", type=int, required=True, metavar="P", help="pipeline ranks")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="micro-batches a step's batch is split into (default 2P)")
    p.add_argument("--memory", type=activations_or_bytes, metavar="BYTES|K",
                   help="memory per rank, as tune's --memory-limit reads it: bytes with a "
                        "unit (40GB, 512MiB: saved activations plus --weight-copies times "
                        "the weights) or K activations a rank may hold, one per stage, or "
                        "chunk, and micro-batch (1F1B needs P; fractional where W keeps part "
                        "of one)")
    p.add_argument("--weight-copies", type=float, default=2.0, metavar="N",
                   help="bytes held per parameter byte besides activations (default 2: "
                        "weights and gradients; Adam's two states make 4)")
    p.add_argument("--layer-costs", metavar="PLAN",
                   help="plan from the per-piece costs in an earlier plan file instead of "
                        "profiling (same model and micro-batches)")
    p.add_argument("--latency", type=float, metavar="MS",
                   help="transfer latency in ms (default: measured between two ranks)")
    p.add_argument("--bandwidth", type=positive_float, metavar="BYTES_PER_MS",
                   help="link bandwidth (default: measured, with --latency: unlimited)")
    p.add_argument("--max-v", type=int, default=4, metavar="V",
                   help="most chunks per rank (interleaved and V-shaped schedules, each "
                        "chunk a range of pieces); 1 for one stage per rank (default 4)")
    p.add_argument("--keep", type=int, default=6, metavar="N",
                   help="splits the dynamic program hands to tune, per objective (default 6)")
    p.add_argument("--synth-time", type=float, default=10.0, metavar="S",
                   help="seconds synth may look for a faster schedule on the chosen split, "
                        "its own costs and memory (0: tune's schedules only; default 10)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="default: 2")
    p.add_argument("--iters", type=int, default=5, metavar="N",
                   help="measured iterations per piece, the median is kept (default: 5)")
    p.add_argument("--timeout", type=timeout_seconds, default=120.0, metavar="S",
                   help="seconds allowed for the transfer measurement (default: 120)")
    add_device_arg(p, "the pieces are timed, as `pipeirc run` would place P ranks")
    p.add_argument("-o", "--output", metavar="PLAN", help="write the plan file (JSON)")
    p.add_argument("--schedule-out", metavar="SCHED",
                   help="write the planned schedule as a .sched file (with its costs)")


def run(args: argparse.Namespace) -> int:
    with device_env(args):  # (read where the stages are timed)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    _check_numbers(args)  # first: the planner's imports take seconds
    from pipeir.models.refs import resolve_splittable
    from pipeir.plan import planfile as pf
    from pipeir.plan.search import plan
    from pipeir.printer import print_schedule
    from pipeir.verify import verify

    mbs = args.microbatches if args.microbatches is not None else 2 * args.ranks
    if "@" in args.model:
        raise UsageError(f"--model {args.model}: name the model without split points; "
                         "choosing them is what plan does")
    model = resolve_splittable(args.model)
    names = ["", *model.split_points()]
    if args.ranks > len(names):
        raise UsageError(f"--ranks {args.ranks}: {args.model} has {len(names)} pieces (its "
                         f"split points and its start), so at most {len(names)} stages")
    earlier = pf.read(args.layer_costs) if args.layer_costs else None
    outs = [resolve_output(path, flag)[0] for flag, path in
            (("-o", args.output), ("--schedule-out", args.schedule_out)) if path is not None]
    if len(outs) == 2 and outs[0] == outs[1]:  # (checked before the measurement)
        raise UsageError(f"-o and --schedule-out both name {args.output}: give two files")
    device = None
    # profiled here (an earlier plan file brings its link too); CUDA asked for is checked
    # either way, so that it never passes silently on a host without it
    if earlier is None or devices.mode() == "cuda":
        from pipeir.runtime.profile import timing_device

        device, why = timing_device(args.ranks)
        if why is not None:
            print(f"note: {why}", file=sys.stderr)
    with Progress("plan") as progress:
        if earlier is not None:
            layers = _reuse(earlier, names, mbs, args)
            how = f"from {args.layer_costs}"
            link = earlier.link if not _link_given(args) else _link(args, progress, device)
        else:
            assert device is not None
            # on CUDA the link first: a GPU in exclusive mode admits one process at a time
            # (on CPU the pieces first: a model that fails fails at once)
            if device.type == "cuda":
                link = _link(args, progress, device)
                layers = _profile(model, args, mbs, progress, device)
            else:
                layers = _profile(model, args, mbs, progress, device)
                link = _link(args, progress, device)
            how = (f"pipeirc plan: medians of {args.iters} runs per piece on this host"
                   + (", one intra-op thread" if device.type == "cpu" else
                      f" on {device.type}"))
        progress(f"searching splits and schedules for {args.ranks} ranks")
        result = plan(layers, args.ranks, mbs, link, memory=args.memory,
                      weight_copies=args.weight_copies, keep=args.keep, max_v=args.max_v,
                      synth_time=args.synth_time)
    best = result.planned.candidate
    text = print_schedule(best.schedule, best.costs.settings())
    print(_report(result, names), end="")
    if args.schedule_out is not None:
        verify(best.schedule)
        write_atomic(args.schedule_out, text, "--schedule-out")
        print(f"wrote {args.schedule_out}")
    if args.output is not None:
        write_atomic(args.output, pf.to_json(result, args.model, text, how), "-o")
        print(f"wrote {args.output} (train with it: pipeirc run --plan {args.output} --model "
              f"{args.model})")
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    if args.ranks < 1:
        raise UsageError(f"--ranks {args.ranks}: need at least 1 rank")
    if args.microbatches is not None and args.microbatches < 1:
        raise UsageError(f"--microbatches {args.microbatches}: need at least 1")
    if args.max_v < 1:
        raise UsageError(f"--max-v {args.max_v}: need at least 1")
    if args.keep < 1:
        raise UsageError(f"--keep {args.keep}: need at least 1")
    if args.warmup < 0 or args.iters < 1:
        raise UsageError("--warmup must be at least 0 and --iters at least 1")
    if not 0 <= args.weight_copies < float("inf"):
        raise UsageError(f"--weight-copies {args.weight_copies:g}: need a finite number >= 0")
    if not 0 <= args.synth_time < float("inf"):
        raise UsageError(f"--synth-time {args.synth_time:g}: need a finite number of seconds "
                         ">= 0")
    if args.latency is not None and not 0 <= args.latency < float("inf"):
        raise UsageError(f"--latency {args.latency:g}: need a finite number of ms >= 0")


def _reuse(earlier: PlanFile, names: list[str], mbs: int, args: argparse.Namespace
           ) -> list[LayerCost]:
    got = [x.name for x in earlier.layers]
    if got != names:
        raise UsageError(f"--layer-costs {args.layer_costs}: its pieces ({', '.join(got[1:])}) "
                         f"are not {args.model}'s ({', '.join(names[1:])})")
    if earlier.microbatches != mbs:
        raise UsageError(f"--layer-costs {args.layer_costs}: its costs are for one of "
                         f"{earlier.microbatches} micro-batches; give --microbatches "
                         f"{earlier.microbatches}, or profile again")
    return list(earlier.layers)


def _profile(model: Splittable, args: argparse.Namespace, mbs: int,
             progress: Progress, device: torch.device) -> list[LayerCost]:
    from pipeir.runtime.profile import layer_costs, profile_pieces

    try:
        pieces = profile_pieces(model, mbs, args.warmup, args.iters, progress, device=device)
    except PipeirError:
        raise
    except Exception as e:
        raise UsageError(f"--model {args.model}: running its pieces failed: "
                         f"{type(e).__name__}: {e}") from None
    return layer_costs(pieces)


def _link_given(args: argparse.Namespace) -> bool:
    """Whether the link needs no measurement: given, or one rank."""
    return args.latency is not None or args.bandwidth is not None or args.ranks == 1


def _link(args: argparse.Namespace, progress: Progress, device: torch.device | None) -> Link:
    """--latency / --bandwidth, else measured between two ranks (none for one rank): gloo,
    or NCCL where the ranks would run on CUDA."""
    from pipeir.plan import Link

    if _link_given(args):
        return Link(args.latency or 0.0, args.bandwidth)
    from pipeir.runtime.dist import backend_for
    from pipeir.runtime.profile import measure_link

    backend = backend_for(device) if device is not None else "gloo"
    progress(f"timing transfers between two {backend} ranks")
    try:
        latency, bandwidth = measure_link(timeout_s=args.timeout, backend=backend)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    return Link(latency, bandwidth)


def _report(result: Plan, names: list[str]) -> str:
    """The per-piece costs, the plan, its bounds and the uniform split's best."""
    unit = "ms"
    rows = [f"pieces: one micro-batch of {result.microbatches} ({unit}, bytes)",
            f"  {'piece':<12} {'F':>8} {'B':>8} {'I':>8} {'W':>8} {'hand-off':>10} "
            f"{'saved':>10} {'W keeps':>10} {'params':>10}"]
    for x in result.layers:
        kept = "all" if x.memory_w_bytes is None else f"{x.memory_w_bytes:.0f}"
        rows.append(f"  {x.name or '(start)':<12} {x.F:8.3f} {x.B:8.3f} {x.I:8.3f} {x.W:8.3f} "
                    f"{x.activation_bytes:10.0f} {x.memory_bytes:10.0f} {kept:>10} "
                    f"{x.param_bytes:10.0f}")
    rows.append(f"link: {result.link.latency:.4g} ms per transfer, "
                + ("unlimited bandwidth" if result.link.bandwidth is None
                   else f"{result.link.bandwidth:.4g} bytes/ms"))
    rows.append(f"tried {result.splits_tried} splits with tune's schedules; "
                + ("no memory budget" if result.memory is None else
                   f"memory per rank: {_budget(result)}"))
    rows.append("")
    rows += _choice("plan", result, result.planned, names)
    rows.append(f"  lower bound {result.bound:.4g} {unit} for this split and placement under "
                f"the budget ({result.gap:+.1%} above it); no split or schedule can beat "
                f"{result.best_bound:.4g} {unit} (pipeir.plan.partition and pipeir.plan.refine "
                "explain both)")
    if result.uniform is None:
        rows.append("uniform split: no schedule of it fits the memory budget")
    else:
        rows += _choice("uniform split", result, result.uniform, names)
        gain = result.gain or 0.0
        rows.append(f"the plan's step is {result.planned.step / result.uniform.step:.2f}x the "
                    f"uniform split's ({gain:.1%} faster)" if gain > 0 else
                    "the uniform split is as fast as any split tried")
    return "\n".join(rows) + "\n"


def _choice(what: str, result: Plan, c: Choice, names: list[str]) -> list[str]:
    from pipeir.plan.layers import bounds, stages_of

    cand = c.candidate
    out = [f"{what}: {', '.join(names[i] for i in c.cut) or '(one stage)'} -> "
           f"{cand.family}" + (f" v={cand.v}" if cand.v > 1 else "")
           + (f", {cand.passes}" if cand.passes else "") + f", {cand.comm} communication: "
           f"step {cand.step_time:.4g} ms (simulated), bubble {cand.bubble:.1%}"]
    stages = stages_of(result.layers, c.cut)
    placement = cand.schedule.config.placement
    for k, ((lo, hi), s) in enumerate(zip(bounds(c.cut, len(names)), stages)):
        first = names[lo] or "(start)"
        span = first if hi - lo == 1 else f"{first} .. {names[hi - 1]}"
        out.append(f"  stage {k} on rank {placement[k]}: {span:<24} F+B {s.F + s.B:8.3f} ms")
    if c.rank_bytes is not None:
        out.append("  held per rank (MiB): "
                   + " ".join(f"{b / 2**20:.4g}" for b in c.rank_bytes))
    return out


def _budget(result: Plan) -> str:
    m = result.memory
    if m is None or m.bytes is None:
        return f"{m} activations"
    return f"{m.bytes / 2**20:.4g} MiB (activations + {result.weight_copies:g} x weights)"
