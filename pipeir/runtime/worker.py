"""One rank's process: join the group, build its stages, run generated programs, report.

A worker reports to its launcher through `emit(message)`: per-step losses and instruction
timestamps, final parameters when asked, and on failure one ("error", ...) message naming the
instruction index, after which it exits at once (the launcher stops the other ranks).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable, MutableSequence, Sequence
from types import ModuleType
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeir.backend.instructions import (
    BackwardInput,
    Batch,
    ForwardCheckpoint,
    IRecv,
    ISend,
    Lowered,
    Offload,
    Recompute,
    Recv,
    Reload,
    Send,
)
from pipeir.backend.table import Row, rank_table
from pipeir.models.refs import resolve
from pipeir.models.spec import build_stage
from pipeir.runtime import checkpoint, shapes
from pipeir.runtime import dist as pdist
from pipeir.runtime.context import CommFailure, Context
from pipeir.runtime.guards import Guard
from pipeir.runtime.job import LOADING_PC, SAVING_PC, Job
from pipeir.runtime.mesh import Mesh, mesh_for, shard
from pipeir.runtime.milestones import mark
from pipeir.runtime.optim import Optim
from pipeir.runtime.shapes import ShapePlan
from pipeir.usercode import stdout_for_good

Emit = Callable[[tuple[Any, ...]], None]

class Progress:
    """Where a rank is, (job, instruction index), in two slots of memory the launcher shares
    and reads when a rank hangs or dies without a word (`pipeir.runtime.launch`).

    NOTE (hot path): `at` runs once per instruction (the context's `on_instr`); it is the
    slots' own `__setitem__` bound to the instruction slot, so it runs no Python frame. The
    job changes only between jobs (`__call__`)."""

    def __init__(self, slots: MutableSequence[int], rank: int):
        self.slots, self.base = slots, 2 * rank
        self.at: Callable[[int], None] = functools.partial(slots.__setitem__, self.base + 1)

    def __call__(self, job: int, pc: int) -> None:
        self.slots[self.base], self.slots[self.base + 1] = job, pc

    @property
    def where(self) -> tuple[int, int]:
        return self.slots[self.base], self.slots[self.base + 1]


def load_program(source: str, name: str, table: tuple[Row, ...]) -> Callable[[Context], None]:
    """Execute a generated rank file and return its `step` bound to the rank's instruction
    table (`pipeir.backend.table`)."""
    module = ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return functools.partial(module.step, table=table)


def split_batch(batch: Sequence[Any], n: int) -> list[tuple[Any, ...]]:
    """Split each part of the batch (inputs, targets) into n micro-batches along dim 0 (sizes
    may differ). A part is a tensor or a dict (nested: any pytree but a list or tuple) of
    tensors, each split alike, and constants, repeated. A list or tuple instead is taken as the
    n micro-batches themselves (a data source of variable-length micro-batches)."""
    out = []
    for t in batch:
        if isinstance(t, list | tuple):
            if len(t) != n:
                raise ValueError(f"the batch gives {len(t)} micro-batches, the schedule runs "
                                 f"{n} (microbatches x accumulate)")
            out.append(tuple(t))
            continue
        if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] >= n:  # no tree to walk
            out.append(torch.tensor_split(t, n))
            continue
        leaves, tree = pytree.tree_flatten(t)
        parts = []
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                parts.append([x] * n)
                continue
            if x.dim() == 0 or x.shape[0] < n:
                raise ValueError(f"a batch of {x.shape[0] if x.dim() else 0} samples cannot be "
                                 f"split into {n} micro-batches (microbatches x accumulate)")
            parts.append(list(torch.tensor_split(x, n)))
        out.append(tuple(pytree.tree_unflatten([p[k] for p in parts], tree) for k in range(n)))
    return out


def samples(x: Any) -> int:
    """The samples of one micro-batch input: the first dimension of its first tensor."""
    t = shapes.tensor_leaves(x)
    return int(t[0].shape[0]) if t and t[0].dim() else 1


def size(x: Any) -> int:
    """The elements of one micro-batch input (for --reorder's planner)."""
    return sum(t.numel() for t in shapes.tensor_leaves(x))


def channels(low: Lowered, mesh: Mesh | None) -> set[tuple[int, int]]:
    """Every directed channel (global sender, global receiver) `low`'s programs transfer on,
    in every replica. (Not commcheck's `posts`: importing the proof would load the compiler,
    networkx included, into every rank.)"""
    pairs: set[tuple[int, int]] = set()
    for r, prog in enumerate(low.programs):
        for ins in prog:
            for c in (ins.posts if isinstance(ins, Batch) else (ins,)):
                if isinstance(c, Send | ISend):
                    pairs.add((r, c.peer))
                elif isinstance(c, Recv | IRecv):
                    pairs.add((c.peer, r))
    if mesh is None:
        return pairs
    at = mesh.shape.rank
    return {(at(a, d), at(b, d)) for a, b in pairs for d in range(mesh.shape.dp)}


def run_job(rank: int, index: int, job: Job, device: torch.device, emit: Emit,
            track: Progress, mesh: Mesh | None = None) -> None:
    low = job.lowered
    pdist.open_channels(channels(low, mesh), device)  # (NCCL: every rank, the same order)
    spec = resolve(job.model)
    rank = rank if mesh is None else mesh.pp_rank
    track(index, -1)  # the job, once: each instruction then sets only its index
    mine = [s for s, r in enumerate(low.placement) if r == rank]
    modules = {s: build_stage(spec, s, low.stages).to(device) for s in mine}
    optim = Optim(spec, modules, low.stages, low.placement, rank, distributed=True, mesh=mesh)
    start = 0
    if job.resume is not None:
        track(index, LOADING_PC)
        start = checkpoint.load(job.resume, modules, optim, device)
        track(index, -1)
    saver = None if job.save is None else checkpoint.Saver(
        job.save, job.run_id, job.keep, job.model, low.stages,
        checkpoint.model_fingerprints(spec, low.stages))
    plan = ShapePlan(spec, low.stages, device)
    if job.layouts:
        plan.preset(pickle.loads(job.layouts))
    # the memory ops move or replay stashes, and an I frees what its W does not need from
    # them: those programs record every step (`SavedActivations.begin_step`)
    stashes = any(isinstance(i, ForwardCheckpoint | Recompute | Offload | Reload | BackwardInput)
                  for i in low.program(rank))
    ctx = Context(spec, modules, low.stages, device, plan, optim,
                  on_instr=track.at, record_every_step=stashes)
    ctx.mesh = mesh
    guard = Guard.install(ctx, low, rank, job.allow_nonfinite)  # runtime/guards.py
    step_fn = load_program(job.sources[rank], f"rank{rank}", rank_table(low, rank))
    last = (low.stages - 1) in mine
    # NOTE: a full garbage collection walks the ~300k objects torch creates at import; one
    # rank's pause stalls every rank waiting on it. Measured on 10 steps of the built-in mlp
    # (one process): full collections took up to 122 ms (217 ms in all) and 30 ms (41 ms)
    # with what exists before the first step frozen out of collection, as here.
    mark(f"rank {rank if mesh is None else mesh.rank}: model built")
    gc.freeze()
    n = low.microbatches * low.accumulate
    cpu = time.process_time()
    for step in range(start, job.steps):
        batch = spec.batch(step)
        guard.begin_step(step, batch)  # runtime/guards.py: the same batch(step) on every rank
        xs, ys = split_batch(batch if mesh is None else shard(batch, job.dp, mesh.replica, n), n)
        if job.plan is not None:
            order = job.plan.order([size(x) for x in xs])
            xs, ys = tuple(xs[k] for k in order), tuple(ys[k] for k in order)
        ctx.begin_step(xs, ys)
        t0 = time.perf_counter()
        step_fn(ctx)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
        now = time.process_time()
        cpu_used, cpu = now - cpu, now
        ctx.end_step()
        guard.end_step()  # the loss check, once per step (runtime/guards.py)
        info = None
        if last:
            st = ctx.stats
            info = {"samples": sum(samples(x) for x in xs),
                    "tokens": (sum(spec.tokens(x) for x in xs) if spec.tokens is not None
                               else None),
                    "grad_norm": st.grad_norm, "lr": st.lr, "skipped": st.skipped}
        emit(("step", index, rank if mesh is None else mesh.rank, step,
              ctx.loss_sum if last else None, t0, t1, ctx.times, info, ctx.reduced,
              cpu_used))  # (begin_step gives the context new lists: nothing to copy)
        emit(("memory", index, rank if mesh is None else mesh.rank, step, ctx.saved.peak,
              dict(ctx.saved.per_stage), dict(ctx.saved.inputs_per_stage),
              dict(ctx.saved.w_per_stage)))
        track(index, -1)
        if step == start:
            mark(f"rank {rank if mesh is None else mesh.rank}: first step")
        done = step + 1
        saves = mesh is None or mesh.replica == 0  # replicas hold the same state
        if saver is not None and saves and (
                done == job.steps or (job.save_every and done % job.save_every == 0)):
            optim.settle()  # (the norm's all-reduce, before the save's collectives)
            track(index, SAVING_PC)
            saver.save(done, modules, optim, rank, None if mesh is None else mesh.pp_group,
                       lambda text: emit(("note", index, text)))
            track(index, -1)
    optim.settle()  # the last step's norm, before the next job or the group's end
    if job.collect:
        emit(("params", index, rank if mesh is None else mesh.rank,
              {s: {k: _numpy(v) for k, v in m.state_dict().items()}
               for s, m in modules.items()},
              {s: {k: _numpy(v.grad) for k, v in m.named_parameters() if v.grad is not None}
               for s, m in modules.items()}))


#: what gloo and NCCL say when a peer went away: a secondary error, never the cause
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted", "remote process exited")


def lost_peer(e: BaseException) -> bool:
    """Whether `e` only says that another rank died or stopped answering."""
    return isinstance(e, CommFailure) or (
        isinstance(e, RuntimeError) and any(t in str(e) for t in _PEER_GONE))


def _numpy(t: torch.Tensor) -> Any:
    t = t.detach().cpu()
    return (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy().copy()


def run_rank(rank: int, world: int, init_method: str, jobs: Sequence[Job], emit: Emit,
             track: Progress, timeout_s: float, env_launched: bool = False,
             local_rank: int | None = None) -> torch.device:
    """Run `jobs` as rank `rank` of `world`; returns the device it ran on. `env_launched`:
    torchrun (or another env:// launcher) started it (`pdist.torchrun_device_kind`; its
    device index is `local_rank`, else its rank); else `pipeirc run` started all `world`
    ranks on this host."""
    if env_launched:
        kind = pdist.torchrun_device_kind()
    else:
        kind, why = pdist.device_kind(world)
        if why is not None and rank == 0:
            emit(("note", 0, f"note: {why}"))
    device = pdist.pick_device(kind, rank if local_rank is None else local_rank)
    pdist.init(rank, world, init_method, timeout_s, device)
    mark(f"rank {rank}: process group")
    try:
        mesh = mesh_for(rank, world, {job.dp for job in jobs},
                        jobs[0].lowered.ranks if jobs else 1, device, timeout_s)
        for i, job in enumerate(jobs):
            run_job(rank, i, job, device, emit, track, mesh)
    finally:
        pdist.shutdown()
    return device


def _die_with_parent() -> None:
    """Linux: get SIGKILLed if the process that started us dies, so no rank is orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def main(rank: int, world: int, init_method: str, jobs: Sequence[Job], queue: Any,
         pcs: Any, timeout_s: float) -> None:
    """Process entry point used by the launcher."""
    mark(f"rank {rank}: started")
    _die_with_parent()
    # the model's output, even written to descriptor 1, goes to stderr: the launcher's stdout
    # is the run's report, and a worker reports through its queue (pipeir.usercode's NOTE)
    stdout_for_good().close()
    torch.set_num_threads(1)
    track = Progress(pcs, rank)
    try:
        device = run_rank(rank, world, init_method, jobs, queue.put, track, timeout_s)
        queue.put(("exit", rank, device.type))
        queue.close()
        queue.join_thread()
    except BaseException as e:
        kind = "comm" if lost_peer(e) else "error"
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{f.filename}:{f.lineno}" for f in reversed(tb)
                      if "pipeir/runtime" not in f.filename), "")
        queue.put(("error", rank, *track.where, kind,
                   f"{type(e).__name__}: {e}".strip(), where))
        queue.close()
        queue.join_thread()
        os._exit(1)
