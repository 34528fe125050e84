"""pipeirc profile: measure a model's stages and this machine's links, write the cost file the
simulator and `pipeirc tune` read, and say whether the model is compute- or
communication-bound (and so whether interleaving can pay)."""

from __future__ import annotations

import argparse
import json
import sys

from pipeir.argtypes import timeout_seconds
from pipeir.cli.common import add_device_arg, device_env
from pipeir.diagnostics import PipeirError, UsageError
from pipeir.files import resolve_output, write_atomic
from pipeir.progress import Progress

ORDER = 105
NAME = "profile"
HELP = "measure a model's per-stage F/B/I/W times and transfer costs; write a cost file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="M",
                   help="mlp, transformer, module:function or file.py[:function]")
    p.add_argument("--nproc", type=int, default=2, metavar="P",
                   help="pipeline ranks: the model is cut into P stages (default 2); "
                        "transfers are measured between two ranks when P > 1")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="micro-batches a step's batch is split into (default 2P); the costs "
                        "are for one of them")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="default: 2")
    p.add_argument("--iters", type=int, default=5, metavar="N",
                   help="measured iterations, the median is kept (default: 5)")
    p.add_argument("--timeout", type=timeout_seconds, default=120.0, metavar="S",
                   help="seconds allowed for the transfer measurement (default: 120)")
    add_device_arg(p, "the stages are timed, as `pipeirc run` would place P ranks")
    p.add_argument("-o", "--output", required=True, metavar="OUT",
                   help="the cost file to write (JSON: OUT.json)")


def run(args: argparse.Namespace) -> int:
    with device_env(args):  # (read where the stages are timed)
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.nproc < 1:
        raise UsageError(f"--nproc {args.nproc}: need at least 1")
    for flag in ("warmup", "iters"):
        if getattr(args, flag) < (0 if flag == "warmup" else 1):
            raise UsageError(f"--{flag} {getattr(args, flag)}: too small")
    mbs = args.microbatches if args.microbatches is not None else 2 * args.nproc
    if mbs < 1:
        raise UsageError(f"--microbatches {mbs}: need at least 1")
    from pipeir.models.refs import resolve

    spec = resolve(args.model)
    resolve_output(args.output, "-o")  # before the measurement (after the import: not over it)
    if not str(args.output).lower().endswith(".json"):  # (cost files are read by suffix)
        raise UsageError(f"-o {args.output}: profile writes a JSON cost file; name it .json "
                         f"(a cost file is read as JSON by its suffix, anything else as TOML)")
    from pipeir.runtime import profile as prof  # torch is imported here, not before
    from pipeir.runtime.dist import backend_for

    device, why = prof.timing_device(args.nproc)
    if why is not None:
        print(f"note: {why}", file=sys.stderr)
    backend = backend_for(device)
    with Progress("profile") as progress:
        def measure() -> tuple[float, float | None] | None:
            if args.nproc == 1:
                return None
            progress(f"timing transfers between two {backend} ranks")
            try:
                return prof.measure_link(timeout_s=args.timeout, backend=backend)
            except RuntimeError as e:
                raise UsageError(str(e)) from None
        # on CUDA the link first: a GPU in exclusive mode admits one process at a time, and
        # this one holds cuda:0 once it has timed the stages (on CPU the stages first: a
        # model that fails fails at once)
        link = measure() if device.type == "cuda" else None
        try:
            stages = prof.profile_stages(spec, args.nproc, mbs, args.warmup, args.iters,
                                         progress, device=device)
        except PipeirError:
            raise
        except Exception as e:
            raise UsageError(f"--model {args.model}: running its stages failed: "
                             f"{type(e).__name__}: {e}") from None
        if device.type != "cuda":
            link = measure()
    meta = {"model": args.model, "stages": args.nproc, "microbatches": mbs,
            "warmup": args.warmup, "iters": args.iters,
            "device": device.type, **({"threads": 1} if device.type == "cpu" else {}),
            "how": f"pipeirc profile: medians; transfers between 2 {backend} ranks on this "
                   "host"}
    settings = prof.cost_settings(stages, link, meta)
    write_atomic(args.output, json.dumps(settings, indent=2) + "\n", "-o")
    print(f"{'stage':>5}  {'F ms':>8}  {'B ms':>8}  {'I ms':>8}  {'W ms':>8}  "
          f"{'act bytes':>10}  {'saved bytes':>11}")
    for k, s in enumerate(stages):
        print(f"{k:>5}  {s.F:8.3f}  {s.B:8.3f}  {s.I:8.3f}  {s.W:8.3f}  "
              f"{s.activation_bytes:10.0f}  {s.memory_bytes:11.0f}")
    if link is not None:
        bw = "too fast to tell" if link[1] is None else f"{link[1] * 1e3 / 1e9:.3g} GB/s"
        print(f"link: latency {link[0]:.4f} ms, bandwidth {bw}")
    kind, ratio = prof.verdict(settings)
    advice = {
        "compute-bound": "interleaving (v chunks per rank) should pay: it divides the bubble "
                         "by v at the price of v times the messages, which are cheap here",
        "balanced": "interleaving pays only with overlapped communication and small v",
        "communication-bound": "avoid interleaving (it multiplies messages by v); prefer "
                               "1F1B or zero bubble (split-backward) with v = 1",
    }[kind]
    for line in prof.unstable(stages):
        print(f"warning: unstable measurement: {line}; close other programs or raise --iters "
              "and profile again", file=sys.stderr)
    if link is None:
        print("one rank: no transfers measured (latency 0)")
    print(f"{kind}: a transfer costs {ratio:.2%} of a forward; {advice}")
    print(f"wrote {args.output} (try: pipeirc tune --costs {args.output} "
          f"--microbatches {mbs})")
    return 0
