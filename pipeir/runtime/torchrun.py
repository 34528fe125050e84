"""Entry point of generated `main.py` under torchrun: one process per rank, env:// init.

    torchrun --nproc-per-node P DIR/main.py [--model mlp] [--steps 20] [--timeout 60]
    torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        DIR/main.py [--dp D]

With N*K = P*D processes for a P-rank schedule, the pipeline is replicated D times (pipeline x
data parallelism, see `pipeir.runtime.mesh`); `--dp` defaults to N*K / P. Plain `env://`
variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) work the same. Every rank
prints its place in the mesh at start; the rank that owns the last stage of replica 0 writes
one line per step (loss and step time) to stdout. A failure (a bad world size, a batch that
does not split over the replicas, a lost peer) is one line on stderr naming the rank and its
groups, and exit code 1, on which torchrun stops every other process. A bad `--model` is
found before the process group starts: global rank 0 says why, every rank exits with 2.

NOTE (torchrun's report). When a worker fails, torchrun prints its own 40-line report (a
traceback of the launcher and a `ChildFailedError` table) after everything the workers
wrote, which pushed pipeir's one line out of sight. Nothing a worker does silences it, but
its "Root Cause" entry shows what the worker left in the error file torchrun names in
TORCHELASTIC_ERROR_FILE (else "To enable traceback see: ..."). So the failing worker writes
its one line there too (`_report`): it is then the last line of text torchrun prints, under
"Root Cause". torchrun picks the root cause by the earliest timestamp, in whole seconds, and
stamps the peers it stopped (no file) with the time it reads their exit: pipeir's is stamped
one second early so that a peer stopped within the same second never wins the tie.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from pipeir.argtypes import positive_int, timeout_seconds
from pipeir.backend.codegen import rank_source
from pipeir.backend.commcheck import prove_file
from pipeir.backend.program_read import load
from pipeir.diagnostics import PipeirError, UsageError
from pipeir.models.refs import resolve
from pipeir.runtime.dist import torchrun_device_kind
from pipeir.runtime.job import Job
from pipeir.runtime.meshshape import MeshShape, check_world
from pipeir.runtime.worker import Progress, run_rank
from pipeir.usercode import stdout_for_good


def main(directory: Path, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="main.py", description="run a compiled pipeir program")
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=positive_int, default=20)
    p.add_argument("--timeout", type=timeout_seconds, default=60.0)
    p.add_argument("--dp", type=positive_int, default=None,
                   help="data-parallel replicas (default: world size / pipeline ranks)")
    args = p.parse_args(argv)
    place = _place(os.environ)
    if isinstance(place, str):
        sys.stderr.write(f"main.py: {place}\n")
        return 2
    try:  # once, before the process group: a bad --model is one line for the whole world
        check_device()
        resolve(args.model)
        lowered, source = load(str(directory / "lowered.json"))
        # the rank files interpret lowered.json's table: an edited tag or peer leaves them as
        # they were, and the program would hang in gloo; prove what runs, as check does
        # (unless it is what compile proved, unedited)
        prove_file(lowered, source)
        sources = tuple(_read(directory / f"rank{r}.py") for r in range(lowered.ranks))
        for r, text in enumerate(sources):  # what `check --lowered` verified is what runs
            if text != rank_source(lowered, r):
                raise UsageError(f"{directory / f'rank{r}.py'}: not what lowered.json lowers "
                                 "to (one of them was edited after `pipeirc compile`); "
                                 "`pipeirc check --lowered` verifies lowered.json, so main.py "
                                 "runs only rank files that agree with it: compile again")
    except PipeirError as e:
        if place[0] == 0:
            _report(f"main.py: {e.render()}")
            sys.stderr.write("(every rank stops; torchrun reports their exit codes below)\n")
        else:  # torchrun stops the others at the first exit: let rank 0 say why first
            time.sleep(1.0)
        return e.exit_code
    job = Job(lowered, sources, args.model, args.steps)
    code = run_env(job, args.timeout, args.dp)
    if code == 0:
        end_rank(0)
    return code


def check_device() -> None:
    """Where this torchrun rank will run, checked before the process group (a bad
    PIPEIR_DEVICE, CUDA asked for without the devices: a UsageError, said once)."""
    try:
        torchrun_device_kind()
    except ValueError as e:
        raise UsageError(str(e)) from None


def _place(env: Mapping[str, str]) -> tuple[int, int] | str:
    """(RANK, WORLD_SIZE) from the environment torchrun sets, or why they are unusable: a
    rank outside the world would wait out the rendezvous and then fail in torch's C++."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return "start me with torchrun --nproc-per-node P main.py (RANK and WORLD_SIZE unset)"
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    except ValueError:
        return (f"RANK={env['RANK']!r} and WORLD_SIZE={env['WORLD_SIZE']!r} must be integers "
                "(torchrun sets them)")
    if world < 1 or not 0 <= rank < world:
        return (f"RANK={rank} is not a rank of a world of WORLD_SIZE={world} (0 <= RANK < "
                "WORLD_SIZE)")
    return rank, world


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read it ({e.__class__.__name__}: {e}); compile "
                         "again with `pipeirc compile -o DIR`") from None


def run_env(job: Job, timeout_s: float, dp: int | None) -> int:
    """Run `job` as this process's rank of a torchrun / env:// world; 0 (then the caller
    ends the rank with `end_rank`), or 2 for a world of the wrong size; on a failure the
    process exits 1 after one message on stderr naming the rank and its groups."""
    place = _place(os.environ)
    if isinstance(place, str):
        sys.stderr.write(f"main.py: {place}\n")
        return 2
    rank, world = place
    try:
        shape = check_world(world, job.lowered.ranks, dp)
        job = replace(job, dp=shape.dp)  # (Job refuses replicas that never all-reduce)
    except ValueError as e:
        _report(f"main.py: rank {rank}: {e}")
        return 2
    pp, replica = shape.coords(rank)
    report = stdout_for_good()  # the model's output, even to descriptor 1, goes to stderr
    report.write(f"rank {rank}/{world} = pp {pp} of {shape.pp}, dp {replica} of {shape.dp} "
                 f"(host {socket.gethostname()}, local rank "
                 f"{os.environ.get('LOCAL_RANK', '?')})\n")

    def emit(msg: tuple[Any, ...]) -> None:
        # the last stage's rank reports the loss; of data-parallel replicas, replica 0's
        if msg[0] == "step" and msg[4] is not None and replica == 0:
            step, loss, t0, t1 = msg[3], msg[4], msg[5], msg[6]
            shard = " (replica 0's shard)" if shape.dp > 1 else ""
            report.write(f"step {step + 1}/{job.steps}  loss {loss:.5f}{shard}  "
                         f"{(t1 - t0) * 1e3:.1f} ms\n")
        elif msg[0] == "note":  # "saved DIR/step-N (...)", from the rank that completed it
            report.write(msg[2] + "\n")

    try:
        local = os.environ.get("LOCAL_RANK")
        run_rank(rank, world, "env://", [job], emit, Progress([0, -1], 0), timeout_s,
                 env_launched=True,
                 local_rank=int(local) if local is not None and local.isdigit() else None)
    except Exception as e:
        _report(f"main.py: {_failure(shape, rank, e)}")
        os._exit(1)  # do not wait for peers that may be gone; torchrun stops the rest
    return 0


def end_rank(code: int) -> NoReturn:
    """End this torchrun rank with `code` once its work is done (process group destroyed,
    files and locks released): output flushed, then `os._exit`.

    NOTE: the rank ends as the launcher's ranks do (multiprocessing ends a child with
    os._exit). Finalizing the interpreter after an overlapped gloo run aborted one run in four
    on torch 2.13's CPU build ("terminate called without an active exception", exit -6, after
    the last step's line), the same with pipeir's earlier runtime, and torchrun reports that
    as a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _report(message: str) -> None:
    """`message` on stderr, and in torchrun's error file when there is one (see the module
    NOTE), so that torchrun's report ends with it."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    stamp = str(int(time.time()) - 1)
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": stamp}}}
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f)
    except OSError:
        pass  # the line on stderr stands alone, as it did before torchrun read files


def _failure(shape: MeshShape, rank: int, e: BaseException) -> str:
    from pipeir.runtime.context import CommFailure

    what = "lost communication" if isinstance(e, CommFailure) else "failed"
    groups = f" (in {shape.groups(rank)})" if shape.dp > 1 else ""
    return f"{shape.name(rank)} {what}{groups}: {type(e).__name__}: {e}".strip()
