"""The launcher: start P local rank processes, watch them, collect what they report.

Failure handling (NOTE): a rank that raises reports ("error", rank, job, pc, ...) and exits; a
rank that dies silently (killed, segfault) is seen by its exit code. Either way the launcher
waits a short grace period for the root cause (errors from peers that merely lost their
connection are "comm" errors and rank below real ones), then kills every rank and raises one
`RunError` naming the rank, the instruction and its `.sched` line. A watchdog kills everything
if no rank reports for `stall_s` seconds.

The launcher owns its workers (NOTE): each worker's first act is to start a thread that blocks
on the read end of a pipe (the "leash") whose write end only the launcher holds. However the
launcher ends (return, exception, SIGTERM, SIGKILL) the kernel closes that end, the read sees
end-of-file and the worker SIGKILLs itself. A death signal (prctl PR_SET_PDEATHSIG) cannot do
this: a forkserver's workers are the fork server's children, not the launcher's, and the fork
server in turn waits for its workers (they hold its "alive" pipe), so a killed launcher used to
leave ranks, fork server and resource tracker running. Once the workers are gone the fork
server and the resource tracker see their own pipes close and exit too.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue as queue_mod
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeir.backend.instructions import Lowered
from pipeir.diagnostics import PipeirError
from pipeir.runtime.forkserver import context
from pipeir.runtime.job import LOADING_PC, SAVING_PC, Job
from pipeir.runtime.meshshape import MeshShape
from pipeir.runtime.milestones import mark

GRACE_S = 1.5


class RunError(PipeirError):
    """Training failed at run time (exit code 1)."""

    def __init__(self, message: str):
        from pipeir.diagnostics import Diagnostic

        super().__init__(Diagnostic(message), exit_code=1)


@dataclass
class StepReport:
    """One optimizer step over all ranks: earliest start, latest end, the loss (from the
    rank of the last stage) and `time`, the step time: from the previous step's end (or this
    step's start for the first) to this step's end. Ranks run ahead into the next step while
    others finish, so end-to-end intervals measure throughput where start-to-end would not."""

    job: int
    step: int
    loss: float | None = None
    losses: int = 0  # ranks that reported a loss (one per data-parallel replica)
    start: float = float("inf")
    end: float = 0.0
    ranks: int = 0
    time: float = 0.0
    #: CPU time of the step summed over the ranks' processes (all their threads), measured
    #: like `time` from each rank's previous step end: the work, whatever else the machine ran
    cpu: float = 0.0
    #: from the last stage's rank: samples, tokens (None unless the spec counts them),
    #: grad_norm (before clipping), lr, skipped (fp16: non-finite gradients)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    steps: dict[tuple[int, int], StepReport] = field(default_factory=dict)
    #: (job, rank, step) -> [(pc, t0, t1)] for every instruction
    times: dict[tuple[int, int, int], list[tuple[int, float, float]]] = field(
        default_factory=dict)
    #: data parallelism, (job, rank, step) -> [(stage, when its all-reduce finished)]
    reduced: dict[tuple[int, int, int], list[tuple[int, float]]] = field(default_factory=dict)
    #: job -> stage -> parameter name -> numpy array
    params: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)
    #: job -> stage -> parameter name -> gradient of the last step (numpy)
    grads: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)
    #: job -> global rank -> (its params, its grads), to compare data-parallel replicas
    by_rank: dict[int, dict[int, tuple[Any, Any]]] = field(default_factory=dict)
    #: (job, rank, step) -> the peak bytes of saved activations on the rank's device
    saved_peak: dict[tuple[int, int, int], int] = field(default_factory=dict)
    #: (job, stage) -> the most bytes one micro-batch's forward of the stage saved
    saved_per_stage: dict[tuple[int, int], int] = field(default_factory=dict)
    #: (job, stage) -> the most bytes of input a checkpointed forward of the stage kept
    kept_per_stage: dict[tuple[int, int], int] = field(default_factory=dict)
    #: (job, stage) -> the most bytes one micro-batch's W of the stage still needed after I
    #: (stages whose backward ran split only)
    w_per_stage: dict[tuple[int, int], int] = field(default_factory=dict)
    #: global rank -> the type of the device it ran on ("cpu", "cuda")
    devices: dict[int, str] = field(default_factory=dict)

    def compute_slots(self) -> int:
        """How many ranks could compute at once: the CPU cores they may run on, or a large
        number where they ran on CUDA (one device per rank)."""
        if "cuda" in self.devices.values():
            return 1 << 30
        try:
            return len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            return os.cpu_count() or 1


@dataclass(frozen=True)
class Reporters:
    """Where the launcher passes what ranks report while they run."""

    step: Callable[[StepReport], None] | None = None
    note: Callable[[str], None] | None = None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def describe(lowered: Lowered, rank: int, pc: int) -> str:
    """`#pc `instr` (F(1,0), file.sched:12)` for messages."""
    prog = lowered.program(rank)
    if pc == SAVING_PC:
        return "while saving a checkpoint"
    if pc == LOADING_PC:
        return "while loading the checkpoint"
    if not 0 <= pc < len(prog):
        return "outside any instruction (while setting up or between steps)"
    ins = prog[pc]
    origin = ", ".join(x for x in (ins.op, ins.at) if x)
    return f"at instruction #{pc} `{ins.mnemonic} {ins.operands()}`" + (
        f" ({origin})" if origin else "")


def start_owned(ctx: Any, target: Callable[..., None],
                arglists: Sequence[tuple[Any, ...]]) -> tuple[list[Any], Any]:
    """Start one daemon process of `ctx` per tuple in `arglists`, each running
    `target(*args)` (a module-level function), on a leash: they die with this process however
    it dies. Returns the processes and the leash; closing the leash kills those still running,
    so close it only after stopping or joining them."""
    leash_r, leash_w = ctx.Pipe(duplex=False)
    # NOTE: a fork server's children inherit the environment the fork server started with,
    # not this process's now: an environment variable set since (a model's weights file,
    # say) would reach no rank. So each worker takes the launcher's environment as it is.
    env = dict(os.environ)
    procs = [ctx.Process(target=_on_leash, args=(leash_r, env, target, *args), daemon=True)
             for args in arglists]
    try:
        for p in procs:
            p.start()
    except BaseException:
        leash_w.close()
        raise
    finally:
        leash_r.close()  # only the workers hold the read end; only we hold the write end
    return procs, leash_w


def _on_leash(leash: Any, env: dict[str, str], target: Callable[..., None], *args: Any
              ) -> None:
    """A worker's entry: take the launcher's environment, die when the launcher's end of the
    leash closes, then run (with the garbage collector on: the fork server turns it off,
    `pipeir.runtime.preload`)."""
    gc.enable()
    os.environ.clear()
    os.environ.update(env)
    def wait() -> None:
        with contextlib.suppress(EOFError, OSError):
            leash.recv_bytes()  # the launcher never writes: this returns only at its end
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="pipeir-leash", daemon=True).start()
    target(*args)


def launch(jobs: Sequence[Job], nproc: int, *, timeout_s: float = 60.0,
           stall_s: float | None = None,
           on_step: Callable[[StepReport], None] | None = None,
           on_note: Callable[[str], None] | None = None) -> RunResult:
    """Run `jobs` one after another on `nproc` fresh local processes (gloo on CPU);
    `on_step` gets every step, `on_note` the ranks' lines for the user ("saved DIR/step-N")."""
    ctx = context()
    q = ctx.Queue()
    pcs = ctx.Array("i", [0, -1] * nproc, lock=False)
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs, leash = start_owned(ctx, _entry, [(r, nproc, init_method, list(jobs), q, pcs,
                                              timeout_s) for r in range(nproc)])
    mark("launcher: ranks started")
    result = RunResult()
    stall = stall_s if stall_s is not None else timeout_s + 30.0
    try:
        _watch(procs, q, pcs, jobs, result, stall, Reporters(on_step, on_note))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        leash.close()
        q.close()
    return result


def _entry(*args: Any) -> None:
    from pipeir.runtime import worker

    worker.main(*args)


def _watch(procs: list[Any], q: Any, pcs: Any, jobs: Sequence[Job], result: RunResult,
           stall: float, on: Reporters) -> None:
    n = len(procs)
    exited: set[int] = set()
    errors: list[tuple[Any, ...]] = []
    first_error_at: float | None = None
    last_news = time.monotonic()
    while len(exited) < n:
        try:
            msg = q.get(timeout=0.2)
        except queue_mod.Empty:
            msg = None
        now = time.monotonic()
        if msg is not None:
            last_news = now
            _record(msg, result, exited, errors, on, n)
            if msg[0] == "error" and first_error_at is None:
                first_error_at = now
        dead = [r for r, p in enumerate(procs)
                if not p.is_alive() and p.exitcode not in (0, None) and r not in exited]
        if dead and first_error_at is None:
            first_error_at = now
        if first_error_at is not None and now - first_error_at > GRACE_S and msg is None:
            _drain(q, result, exited, errors, on, n)  # reports sent before the failure
            raise RunError(_blame(errors, dead, procs, pcs, jobs))
        if now - last_news > stall:
            where = "; ".join(f"rank {r}: job {pcs[2 * r]} "
                              f"{_describe(jobs[pcs[2 * r]], r, pcs[2 * r + 1])}"
                              for r in range(n))
            raise RunError(f"no rank made progress for {stall:.0f} s; stopped all {n} ranks "
                           f"({where})")
    for r, p in enumerate(procs):
        p.join(10)
        if p.exitcode not in (0, None):
            raise RunError(f"rank {r} exited with code {p.exitcode} after finishing")


def _drain(q: Any, result: RunResult, exited: set[int], errors: list[tuple[Any, ...]],
           on: Reporters, n: int) -> None:
    while True:
        try:
            msg = q.get(timeout=0.05)
        except queue_mod.Empty:
            return
        _record(msg, result, exited, errors, on, n)


def _record(msg: tuple[Any, ...], result: RunResult, exited: set[int],
            errors: list[tuple[Any, ...]], on: Reporters, n: int) -> None:
    kind = msg[0]
    if kind == "step":
        _, job, rank, step, loss, t0, t1, times, info, reduced, cpu = msg
        rep = result.steps.setdefault((job, step), StepReport(job, step))
        rep.start, rep.end, rep.ranks = min(rep.start, t0), max(rep.end, t1), rep.ranks + 1
        rep.cpu += cpu
        if loss is not None:  # data-parallel replicas: the mean of their (equal) shards'
            rep.losses += 1
            rep.loss = loss if rep.loss is None else rep.loss + (loss - rep.loss) / rep.losses
        if info is not None:
            if not rep.info:
                rep.info = dict(info)
            else:  # another replica's last stage: its samples and tokens add up
                for k in ("samples", "tokens"):
                    if rep.info.get(k) is not None and info.get(k) is not None:
                        rep.info[k] += info[k]
        result.times[(job, rank, step)] = times
        if reduced:
            result.reduced[(job, rank, step)] = reduced
        if rep.ranks == n:
            prev = result.steps.get((job, step - 1))
            rep.time = rep.end - (prev.end if prev is not None else rep.start)
            if on.step is not None:
                on.step(rep)
    elif kind == "memory":
        _, job, rank, step, peak, per_stage, kept, for_w = msg
        result.saved_peak[(job, rank, step)] = peak
        for sizes, into in ((per_stage, result.saved_per_stage), (kept, result.kept_per_stage),
                            (for_w, result.w_per_stage)):
            for s, b in sizes.items():
                into[(job, s)] = max(b, into.get((job, s), 0))
    elif kind == "params":
        _, job, rank, params, grads = msg
        result.params.setdefault(job, {}).update(params)
        result.grads.setdefault(job, {}).update(grads)
        result.by_rank.setdefault(job, {})[rank] = (params, grads)
    elif kind == "note":
        if on.note is not None:
            on.note(msg[2])
    elif kind == "exit":
        _, rank, device = msg
        exited.add(rank)
        result.devices[rank] = device
    elif kind == "error":
        errors.append(msg)


def _blame(errors: list[tuple[Any, ...]], dead: list[int], procs: list[Any], pcs: Any,
           jobs: Sequence[Job]) -> str:
    n = len(procs)
    real = [e for e in errors if e[4] != "comm"]
    if real:
        _, rank, job, pc, _, text, where = real[0]
        at = f" (raised at {where})" if where else ""
        return (f"{_name(jobs[job], rank)} failed {_describe(jobs[job], rank, pc)}: "
                f"{text}{at}{_groups(jobs[job], rank)}; stopped all {n} ranks")
    errored = {e[1] for e in errors}
    silent = [r for r in range(n) if procs[r].exitcode not in (0, None) and r not in errored]
    if silent:
        r = silent[0]
        code = procs[r].exitcode
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        job, pc = pcs[2 * r], pcs[2 * r + 1]
        return (f"{_name(jobs[job], r)} died ({how}) {_describe(jobs[job], r, pc)}"
                f"{_groups(jobs[job], r)}; "
                f"stopped all {n} ranks")
    _, rank, job, pc, _, text, _ = errors[0]
    lost = (f"{_name(jobs[job], rank)} lost communication {_describe(jobs[job], rank, pc)}: "
            f"{text}")
    hung = [r for r in range(n) if r not in errored and procs[r].is_alive()]
    if hung:  # only communication errors, and a live rank that reported none: it is the cause
        r = hung[0]
        hjob, hpc = pcs[2 * r], pcs[2 * r + 1]
        also = "".join(f"; {_name(jobs[hjob], x)} gave no error either, "
                       f"{_describe(jobs[pcs[2 * x]], x, pcs[2 * x + 1])}" for x in hung[1:])
        return (f"{_name(jobs[hjob], r)} hung {_describe(jobs[hjob], r, hpc)}"
                f"{_groups(jobs[hjob], r)}: it raised no error while its peers timed out "
                f"waiting for it ({lost}{also}); stopped all {n} ranks")
    others = "; ".join(f"rank {r} was {_describe(jobs[pcs[2 * r]], r, pcs[2 * r + 1])}"
                       for r in range(n) if r not in errored)
    return (f"{_name(jobs[job], rank)} lost communication {_describe(jobs[job], rank, pc)}"
            f"{_groups(jobs[job], rank)}: "
            f"{text}" + (f" ({others})" if others else "") + f"; stopped all {n} ranks")


def _shape(job: Job) -> MeshShape:
    return MeshShape(job.lowered.ranks, job.dp)


def _describe(job: Job, rank: int, pc: int) -> str:
    """`describe` for global rank `rank` (its pipeline rank's program)."""
    return describe(job.lowered, _shape(job).coords(rank)[0], pc)


def _name(job: Job, rank: int) -> str:
    return _shape(job).name(rank)


def _groups(job: Job, rank: int) -> str:
    return f" (in {_shape(job).groups(rank)})" if job.dp > 1 else ""
