"""The measuring half of `pipeirc profile`: time each stage's F, B, I and W, size what crosses
each stage boundary and what each stage keeps for its backward, and time point-to-point
transfers between two ranks. Produces the settings of a cost file (pipeir.sim.costs).

NOTE (how, and why so). Compute is measured in this one process, stage by stage, on the first
micro-batch of step 0's batch split into `microbatches`, on the device the ranks would run on
(`timing_device`: cuda:0, or the CPU): the pipeline runs the same modules on the same
shapes, and one process avoids ranks competing for the CPU while being timed. Each figure is
the median of `iters` runs after `warmup` runs (on CUDA each clock reading waits for the
queued kernels). B is a full backward; I and W are timed exactly as the runtime splits them
(pipeir.runtime.splitgrad: I computes the input gradient and saves what W needs, so I + W is
about B). Stage 0's I is zero: its input needs no gradient, and its W is the whole backward.
Activation memory is the bytes autograd saves for backward, counted with saved-tensor hooks.
Transfers: rank 0 and rank 1 of a fresh group (gloo, or NCCL between cuda:0 and cuda:1 where
the ranks would run on CUDA) ping-pong a small and a large message; latency is half the
fastest small round trip, bandwidth the extra bytes over the extra time (fastest of a few:
the usual microbenchmark figure, least disturbed by other load).

NOTE (unstable measurements). A median of a handful of runs hides a machine that was busy
for some of them, and a cost file measured so sends `tune` after a phantom (a W of 14.5 ms
in one profile, 0.35 ms in the next). Each op's spread across its measured runs is kept
(`Spread`): the coefficient of variation, stdev / mean. Above `UNSTABLE_CV` the op is
flagged (`unstable`) and `pipeirc profile` warns, naming the stage, the op and the runs'
range; the cost file's `meta.spread` records every op's figure. One profile cannot see noise
that lasts its whole run: only a second profile shows that.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeir.diagnostics import UsageError
from pipeir.models.spec import ModelSpec, autocast_dtype, build_stage, call_stage
from pipeir.models.splittable import Splittable
from pipeir.plan.layers import LayerCost
from pipeir.runtime import dist as pdist
from pipeir.runtime.context import to_device
from pipeir.runtime.memory import SavedActivations, input_bytes
from pipeir.runtime.shapes import grad_leaves, tensor_leaves
from pipeir.runtime.splitgrad import backward_input_many, backward_weight, weight_nodes
from pipeir.runtime.worker import split_batch

_CPU = torch.device("cpu")
SMALL_BYTES = 64
LARGE_BYTES = 16 * 2**20

#: The coefficient of variation (stdev / mean of an op's measured runs) above which the op's
#: time is flagged unstable. Quiet CPU runs of these ops vary by a few percent; 0.5 means a
#: run took about twice the others (or one took ten times): the median may then be either.
UNSTABLE_CV = 0.5

#: The timer profiling reads (seconds); a test replaces it with a noisy one.
Clock = Callable[[], float]


@dataclass(frozen=True)
class Spread:
    """How an op's measured runs (ms) varied: the coefficient of variation (0 with fewer
    than two runs), the fastest and slowest run, and how many there were."""

    cv: float
    low: float
    high: float
    runs: int

    @classmethod
    def of(cls, times: list[float]) -> Spread:
        mean = statistics.fmean(times)
        cv = statistics.stdev(times) / mean if len(times) > 1 and mean > 0 else 0.0
        return cls(cv, min(times), max(times), len(times))


NO_SPREAD = Spread(0.0, 0.0, 0.0, 0)  # an op not measured (stage 0's I, a stage without W)


@dataclass(frozen=True)
class StageTimes:
    F: float  # ms; the last stage's F includes the loss
    B: float
    I: float  # noqa: E741
    W: float
    activation_bytes: float  # the output crossing to the next stage
    memory_bytes: float  # what autograd keeps from F until the backward
    param_bytes: float = 0.0  # the weight gradients data parallelism all-reduces
    input_bytes: float = 0.0  # the stage input, which a checkpointed forward keeps
    memory_w_bytes: float | None = None  # of memory_bytes, what W still needs after I
    spread: Mapping[str, Spread] = field(default_factory=dict)  # "F", "B", "I", "W"


def unstable(stages: Sequence[StageTimes], threshold: float = UNSTABLE_CV) -> list[str]:
    """One line for each op whose runs varied more than `threshold` (see the module NOTE),
    naming the stage, the op and the runs' range."""
    out = []
    for k, st in enumerate(stages):
        for op, sp in st.spread.items():
            if sp.cv > threshold:
                out.append(f"stage {k} {op}: {sp.runs} runs took {sp.low:.3g} to "
                           f"{sp.high:.3g} ms (coefficient of variation {sp.cv:.2f}, over "
                           f"{threshold:g}); the cost file keeps the median, "
                           f"{getattr(st, op):.3g} ms, which may not be this op's time")
    return out


def _median_ms(fn: Callable[[], Any], warmup: int, iters: int, clock: Clock
               ) -> tuple[float, Spread]:
    """Median ms of `fn()` over `iters` runs after `warmup`, and the runs' spread."""
    return _timed_after(lambda: (), fn, warmup, iters, clock)


def timing_device(ranks: int) -> tuple[torch.device, str | None]:
    """The device `ranks` pipeline ranks on this host would run on (`pipeir.runtime.dist`),
    where their stages are timed (cuda:0 or the CPU; not made current, so nothing is set up
    on it before it is used), and a note where CUDA is here but too few devices for the
    ranks; `PIPEIR_DEVICE=cuda` without them is a UsageError."""
    try:
        kind, why = pdist.device_kind(ranks)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return (torch.device("cuda", 0) if kind == "cuda" else _CPU), why


def profile_stages(spec: ModelSpec, stages: int, microbatches: int, warmup: int = 2,
                   iters: int = 5, progress: Callable[[str], None] | None = None,
                   clock: Clock = time.perf_counter,
                   device: torch.device = _CPU) -> list[StageTimes]:
    """Per-stage op times and sizes for one micro-batch (see the module NOTE); `progress`
    hears of each stage before it is measured (`pipeir.progress`); `clock` is the timer;
    `device` the one the ranks will run on (on CUDA, each reading of the clock waits for the
    device's queued work first: kernels run asynchronously, so host time alone would count
    launching them, not running them).

    Runs with one intra-op thread: a pipeline rank is one process per core, and OpenMP
    threads spinning against each other on a shared CPU make timings 1000x noisier.
    """
    xs, ys = split_batch(spec.batch(0), microbatches)
    x, y = to_device(xs[0], device), to_device(ys[0], device)
    if device.type == "cuda":
        clock = _synced(clock, device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out: list[StageTimes] = []
        for s in range(stages):
            if progress is not None:
                progress(f"timing stage {s + 1}/{stages} ({warmup} warm-up, {iters} measured "
                         "runs of F, B, I and W)")
            times, x = _profile_stage(spec, s, stages, x, y, warmup, iters, clock, device)
            out.append(times)
        return out
    finally:
        torch.set_num_threads(threads)


def profile_pieces(model: Splittable, microbatches: int, warmup: int = 2, iters: int = 5,
                   progress: Callable[[str], None] | None = None,
                   clock: Clock = time.perf_counter, device: torch.device = _CPU
                   ) -> list[tuple[str, StageTimes]]:
    """Every piece of a `Splittable` (the model cut at all its split points) timed and sized
    as a stage of its own, named by the split point where it begins ("" for the first): the
    per-layer costs `pipeirc plan` chooses cut points from. `clock`, `device` as
    `profile_stages`."""
    points = list(model.split_points())
    times = profile_stages(model.at(points), len(points) + 1, microbatches, warmup, iters,
                           progress, clock, device)
    return list(zip(["", *points], times))


def layer_costs(pieces: Sequence[tuple[str, StageTimes]]) -> list[LayerCost]:
    """`profile_pieces`'s figures as the planner's per-piece costs (`pipeir.plan`), what W
    keeps after I included: one conversion for `pipeirc plan` and the planning bench."""
    return [LayerCost(name, t.F, t.B, t.I, t.W, t.activation_bytes, t.memory_bytes,
                      t.param_bytes, t.input_bytes, t.memory_w_bytes) for name, t in pieces]


def _synced(clock: Clock, device: torch.device) -> Clock:
    """`clock`, read after the work queued on `device` has run."""
    def read() -> float:
        torch.cuda.synchronize(device)
        return clock()
    return read


def _profile_stage(spec: ModelSpec, s: int, stages: int, x: Any, y: Any,
                   warmup: int, iters: int, clock: Clock, device: torch.device
                   ) -> tuple[StageTimes, Any]:
    """Stage s's times on input `x` (a tensor or a structure whose tensors that carry a
    gradient require grad, on `device`), and its output (the next stage's input, likewise)."""
    module = build_stage(spec, s, stages).to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    last = s == stages - 1
    dtype = autocast_dtype(spec)

    def fresh(record: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
              ) -> tuple[Any, Any]:
        inp = pytree.tree_map(_leaf, x)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            with record():
                o = call_stage(module, inp)
            return inp, spec.loss(o, y) if last else o

    # the bytes autograd saves, counted as the runtime counts them (parameters are not
    # activations; tensors that share storage count once)
    saved = SavedActivations(device, module.parameters())
    recorded, o = fresh(lambda: saved.recording((s, 0)))
    roots = grad_leaves(o)
    grads = None if last else [torch.ones_like(t) for t in roots]
    needs_grad = s > 0 and bool(grad_leaves(pytree.tree_map(_leaf, x)))

    def full(i: Any, o: Any) -> None:
        if grad_leaves(o):
            torch.autograd.backward(grad_leaves(o), grads)

    def split(i: Any, o: Any) -> tuple[Any, Any]:
        return backward_input_many(grad_leaves(o), grads, grad_leaves(i) if s else [])

    # what W still needs after I: I on the recorded forward frees the rest, as the runtime's
    # I does (`SavedActivations.after_input`), and W then runs on what is left
    work = split(recorded, o)[1]
    saved.after_input((s, 0), weight_nodes(work))
    backward_weight(work)
    f, f_spread = _median_ms(fresh, warmup, iters, clock)
    b, b_spread = _timed_after(fresh, full, warmup, iters, clock)
    # I and W as the runtime computes them (pipeir.runtime.splitgrad): I saves what W needs,
    # so W does not walk the activation-gradient path again
    i_t, i_spread = 0.0, NO_SPREAD
    if needs_grad:
        i_t, i_spread = _timed_after(fresh, split, warmup, iters, clock)
    w, w_spread = 0.0, NO_SPREAD
    if params:
        def after_input() -> tuple[Any, Any]:
            return split(*fresh())[1], None
        w, w_spread = _timed_after(after_input, lambda work, _: backward_weight(work), warmup,
                                   iters, clock)
    spread = {"F": f_spread, "B": b_spread, "I": i_spread, "W": w_spread}
    for p in module.parameters():
        p.grad = None
    act = 0.0 if last else float(sum(t.numel() * t.element_size() for t in tensor_leaves(o)))
    weights = float(sum(p.numel() * p.element_size() for p in params))
    return (StageTimes(f, b, i_t, w, act, float(saved.per_stage[s]), weights,
                       float(input_bytes(x)), float(saved.w_per_stage.get(s, 0)), spread),
            pytree.tree_map(lambda t: _leaf(t, keep=True), o))


def _leaf(t: Any, keep: bool = False) -> Any:
    """A tensor detached from its graph, requiring grad if it did (`keep`: and is floating
    point); other values as they are."""
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().requires_grad_(t.requires_grad and (keep or t.is_floating_point()))


def _timed_after(setup: Callable[[], tuple[Any, ...]], fn: Callable[..., Any],
                 warmup: int, iters: int, clock: Clock) -> tuple[float, Spread]:
    """Median ms of `fn(*setup())`, the setup (e.g. a fresh forward) not timed, and the
    spread of the measured runs."""
    times = []
    for k in range(warmup + iters):
        args = setup()
        t0 = clock()
        fn(*args)
        t1 = clock()
        if k >= warmup:
            times.append((t1 - t0) * 1e3)
    return statistics.median(times), Spread.of(times)


def measure_link(timeout_s: float = 60.0, rounds: int = 10, backend: str = "gloo"
                 ) -> tuple[float, float | None]:
    """(latency in ms, bandwidth in bytes per ms or None when too fast to tell) between two
    fresh ranks on this host, of `backend` (nccl: between cuda:0 and cuda:1, as the ranks
    of a run on CUDA talk); each figure is the fastest of `rounds` round trips."""
    import multiprocessing as mp

    from pipeir.runtime.launch import free_port, start_owned

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{free_port()}"
    procs, leash = start_owned(ctx, _link_worker, [(r, init, rounds, timeout_s, q, backend)
                                                   for r in range(2)])
    try:
        got = q.get(timeout=timeout_s)
    except Exception:
        raise RuntimeError(f"the transfer measurement did not finish in {timeout_s:g} s") \
            from None
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        leash.close()
    if isinstance(got, str):
        raise RuntimeError(f"the transfer measurement failed: {got}")
    small, large = got
    latency = small / 2
    extra = large / 2 - latency
    # a link faster than the timer can tell is reported as unlimited bandwidth
    return latency, (LARGE_BYTES - SMALL_BYTES) / extra if extra > 0 else None


def _link_worker(rank: int, init: str, rounds: int, timeout_s: float, q: Any,
                 backend: str = "gloo") -> None:
    from datetime import timedelta

    import torch.distributed as dist

    try:
        device = torch.device("cuda", rank) if backend == "nccl" else _CPU
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=2,
                                timeout=timedelta(seconds=timeout_s),
                                device_id=device if device.type == "cuda" else None)
        result = []
        for size in (SMALL_BYTES, LARGE_BYTES):
            t = torch.zeros(size // 4, dtype=torch.float32, device=device)
            times = []
            for k in range(rounds + 2):
                t0 = time.perf_counter()
                if rank == 0:
                    dist.send(t, 1)
                    dist.recv(t, 1)
                else:
                    dist.recv(t, 0)
                    dist.send(t, 0)
                if device.type == "cuda":  # (NCCL returns before the transfer has run)
                    torch.cuda.synchronize(device)
                if k >= 2:
                    times.append((time.perf_counter() - t0) * 1e3)
            result.append(min(times))
        if rank == 0:
            q.put(tuple(result))
        dist.destroy_process_group()
    except Exception as e:  # reported to the parent, which raises it as a clear error
        if rank == 0:
            q.put(f"{type(e).__name__}: {e}")


def cost_settings(stages: list[StageTimes], link: tuple[float, float | None] | None,
                  meta: dict[str, Any]) -> dict[str, Any]:
    """A cost file's contents (the JSON object) from the measurements."""
    spread = {"measure": "coefficient of variation (stdev / mean) of each op's measured "
                         "runs; over the threshold, profile warned",
              "threshold": UNSTABLE_CV,
              "stage": {str(k): {op: round(sp.cv, 4) for op, sp in s.spread.items()
                                 if sp.runs}
                        for k, s in enumerate(stages)}}
    out: dict[str, Any] = {"version": 2, "unit": "ms",
                           "meta": {**meta, "torch": torch.__version__, "spread": spread}}
    out["F"] = statistics.median(s.F for s in stages)
    out["I"] = statistics.median(s.I for s in stages)
    out["W"] = statistics.median(s.W for s in stages)
    out["B"] = statistics.median(s.B for s in stages)
    if link is not None:
        out["latency"] = link[0]
        if link[1] is not None:
            out["bandwidth"] = link[1]
    acts = [s.activation_bytes for s in stages[:-1]]
    out["activation_bytes"] = max(acts, default=0.0)
    out["memory_bytes"] = max(s.memory_bytes for s in stages)
    splits = [s.memory_w_bytes for s in stages if s.memory_w_bytes is not None]
    if splits:  # (within memory_bytes: no stage's W keeps more than its forward saved)
        out["memory_w_bytes"] = max(splits)
    out["stage"] = {str(k): {"F": s.F, "B": s.B, "I": s.I, "W": s.W,
                             **({"activation_bytes": s.activation_bytes}
                                if k < len(stages) - 1 else {}),
                             "memory_bytes": s.memory_bytes,
                             **({"memory_w_bytes": s.memory_w_bytes}
                                if s.memory_w_bytes is not None else {}),
                             "param_bytes": s.param_bytes, "input_bytes": s.input_bytes}
                    for k, s in enumerate(stages)}
    out["param_bytes"] = max(s.param_bytes for s in stages)
    return out


def verdict(settings: dict[str, Any]) -> tuple[str, float]:
    """("compute-bound" | "balanced" | "communication-bound", transfer / compute per op)."""
    compute = float(settings["F"])
    bandwidth = settings.get("bandwidth")
    transfer = float(settings.get("latency", 0.0)) + (
        float(settings["activation_bytes"]) / bandwidth if bandwidth else 0.0)
    ratio = transfer / compute if compute > 0 else float("inf")
    kind = ("compute-bound" if ratio < 0.1 else "communication-bound" if ratio > 0.5
            else "balanced")
    return kind, ratio
