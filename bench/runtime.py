"""Runtime benchmark: pipeir's generated programs against torch.distributed.pipelining.

    python bench/runtime.py                 # real and sleep modes
    python bench/runtime.py --mode real     # pipeir vs torch step times (wall and CPU)
    python bench/runtime.py --mode real --ranks 4 --models transformer --kinds zbv
    python bench/runtime.py --mode noop     # pipeir's added cost per instruction
    python bench/runtime.py --mode sleep    # synthetic compute: measured vs simulated bubble

real: the same model, the same data and the same schedule on gloo ranks, pipeir against
torch's own schedule class: 1F1B with one stage per rank (`Schedule1F1B`), interleaved 1F1B
with v=2 (`ScheduleInterleaved1F1B`) and ZB-V, two stages per rank in a V
(`ScheduleZBVZeroBubble`); for the bench's MLP (below: wider than the built-in) and the
built-in transformer (at one sequence length: torch's stages fix their shapes at the
first step), at each of --ranks. Runs alternate A/B (pipeir as compiled by default, with
overlapped communication; pipeir --blocking; with --gloo, pipeir with its transfers through
gloo as torch's are, not through pipes (`pipeir.runtime.pipes`); torch; then again), and each
system's median over all measured steps (first steps of a run dropped as warm-up) is
compared. A step's wall time runs from the previous step's end to its own end (latest rank),
the same for both systems; its CPU time is the CPU time of every rank process (all threads)
over the same interval, summed over the ranks: on a machine that others load, the work done
is read from CPU time, the waiting from wall time.

ops: per built-in model and stage (4 stages), median times of F, B, I and W as the runtime
runs them (I and W split as in `pipeir.runtime.splitgrad`), and of the previous W that took
parameter gradients over the whole kept graph (about a full backward).

noop: pipeir's added cost per instruction. Four stages on one rank (interleaved 1F1B, p=1,
v=4: loads, forwards, losses, backwards and hand-offs, no communication) of a model whose
stages multiply by one scalar, against a plain loop: the same torch calls written by hand in
this process, with no bookkeeping. Per micro-batch it runs each stage's forward on a detached
input (requiring grad from stage 1 on, as a hand-off makes it), the loss scaled by 1/m, then
one `torch.autograd.backward` per stage from its output with the gradient of the next stage's
input (the runtime's B); then the step of each stage's optimizer (`ModelSpec.optimizer` is
called once per stage, as torchtitan builds one per model part: a step's fixed cost, about
50 us each here, is the model's, not the runtime's). The two alternate, one rank
process per round against the loop in this process; medians of every step after warm-up.
(pipeir median step - plain median step) / instructions per step is the added cost, printed
for CPU time (the rank process's, every thread; the loop's, this process's) and wall time.

sleep: every forward sleeps F ms and every backward B ms instead of computing, so four ranks do
not fight over two cores; the measured bubble (pipeir's instruction timestamps) is compared
with the simulator's prediction for the same costs.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import pipeir
from pipeir.backend.codegen import rank_source
from pipeir.models import ModelSpec
from pipeir.runtime.launch import free_port, launch
from pipeir.runtime.measure import (
    calibrated_prediction,
    expand_rounds,
    measured_result,
    transfer_latency,
)
from pipeir.runtime.worker import Job
from pipeir.sim import CostModel, simulate

HERE = Path(__file__).resolve()
WIDTH, BLOCKS, BATCH = 256, 8, 128
SLEEP_F, SLEEP_B = 0.010, 0.020  # seconds
NOOP_M, NOOP_V = 16, 4  # noop mode: micro-batches, stages (all on one rank)


# ---- models (resolved by file path in every worker) ---------------------------------------------
def _stage(s: int, stages: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(max(1, BLOCKS // stages)):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step % 4)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def spec() -> ModelSpec:
    return ModelSpec(stage=_stage, loss=nn.functional.mse_loss, batch=_batch)


class SleepFn(torch.autograd.Function):
    """F sleeps SLEEP_F, B sleeps SLEEP_B: step times then depend on the schedule, not on how
    the shared cores are split between ranks (bench/dp.py uses it too)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(SLEEP_F)
        return x * w

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        time.sleep(SLEEP_B)
        return g, g.sum(0)


class SleepStage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepFn.apply(x, self.w)


class NoopStage(nn.Module):
    """A stage with (almost) no compute: what remains of a step is the runtime's own cost."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def noop_spec() -> ModelSpec:
    return ModelSpec(stage=lambda s, n: NoopStage(), loss=lambda y, t: ((y - t) ** 2).mean(),
                     batch=lambda step: (torch.ones(NOOP_M, 4), torch.zeros(NOOP_M, 4)),
                     optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01))


def transformer_spec() -> ModelSpec:
    """The built-in transformer at one sequence length (its even steps' batches): torch's
    PipelineStage fixes its shapes at the first step, the built-in alternates two lengths."""
    from dataclasses import replace

    from pipeir.models import resolve

    base = resolve("transformer")
    return replace(base, batch=lambda step: base.batch(2 * step))


def sleep_spec() -> ModelSpec:
    return ModelSpec(stage=lambda s, n: SleepStage(), loss=lambda y, t: ((y - t) ** 2).mean(),
                     batch=lambda step: (torch.zeros(16, 8), torch.zeros(16, 8)))


# ---- torch.distributed.pipelining ---------------------------------------------------------------
#: the schedules compared: pipeir's library name, v (stages per rank), torch's class name
KINDS = {"1f1b": ("1f1b", 1, "Schedule1F1B"),
         "interleaved": ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B"),
         "zbv": ("zb-v", 2, "ScheduleZBVZeroBubble")}
#: the models compared: the bench's MLP (this file) and the built-in transformer
MODELS = {"mlp": f"{HERE}:spec", "transformer": f"{HERE}:transformer_spec"}


def _torch_worker(rank: int, world: int, port: int, kind: str, m: int, steps: int,
                  model: str, out: object) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining

    from pipeir.models import resolve
    from pipeir.models.spec import build_stage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    _, v, cls = KINDS[kind]
    sp = resolve(model)
    n = world * v
    # the stages pipeir's schedule places on this rank (the V of ZBV: r and 2p-1-r)
    stage_ids = sorted(_schedule(kind, world, m).config.stages_of(rank))
    mods = {s: build_stage(sp, s, n) for s in stage_ids}
    stages = [pipelining.PipelineStage(mods[s], s, n, torch.device("cpu")) for s in stage_ids]
    sched_cls = getattr(pipelining, cls)
    sched = sched_cls(stages if v > 1 else stages[0], m, loss_fn=sp.loss)
    opt = sp.optimizer([p for mod in mods.values() for p in mod.parameters()])
    times = []
    cpu = time.process_time()
    for step in range(steps):
        x, y = sp.batch(step)
        opt.zero_grad()
        t0 = time.perf_counter()
        args = (x,) if 0 in stage_ids else ()
        kwargs = {"target": y, "losses": []} if n - 1 in stage_ids else {}
        sched.step(*args, **kwargs)
        opt.step()
        now = time.process_time()
        times.append((t0, time.perf_counter(), now - cpu))
        cpu = now
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, times)
    if rank == 0:
        out.put(gathered)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def run_torch(kind: str, world: int, m: int, steps: int, model: str = MODELS["mlp"]
              ) -> tuple[list[float], list[float]]:
    """torch's step times (the same definition as StepReport.time) and CPU times (summed
    over the ranks, as StepReport.cpu)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_torch_worker, args=(r, world, port, kind, m, steps, model, q))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 600
    while True:  # a rank that fails ends the run now, not at the deadline
        try:
            gathered = q.get(timeout=1)
            break
        except queue.Empty:
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                why = f"rank {failed[0]} failed" if failed else "timed out"
                raise RuntimeError(f"torch {kind} on {world} ranks ({model}): {why}") from None
    for p in procs:
        p.join(60)
    ends = [max(g[s][1] for g in gathered) for s in range(steps)]  # type: ignore[index]
    start = min(g[0][0] for g in gathered)  # type: ignore[index]
    cpus = [sum(g[s][2] for g in gathered) for s in range(steps)]  # type: ignore[index]
    return [e - p for e, p in zip(ends, [start, *ends])], cpus


# ---- pipeir -------------------------------------------------------------------------------------
def _schedule(kind: str, world: int, m: int) -> pipeir.Schedule:
    name, v, _ = KINDS[kind]
    return pipeir.library.get(name, world, m, **({"v": v} if "v" in pipeir.library.params(name)
                                                 else {}))


def run_pipeir(kind: str, world: int, m: int, steps: int, overlap: bool,
               model: str = MODELS["mlp"], pipes: bool = True
               ) -> tuple[list[float], object, object]:
    """`pipes` False: transfers through gloo, as torch's (`PIPEIR_P2P_PIPES=off`)."""
    low = pipeir.compile(_schedule(kind, world, m), overlap=overlap).lowered
    job = Job(low, tuple(rank_source(low, r) for r in range(world)), model, steps)
    old = os.environ.pop("PIPEIR_P2P_PIPES", None)
    if not pipes:
        os.environ["PIPEIR_P2P_PIPES"] = "off"  # (each rank takes the launcher's)
    try:
        res = launch([job], world, timeout_s=120)
    finally:
        os.environ.pop("PIPEIR_P2P_PIPES", None)
        if old is not None:
            os.environ["PIPEIR_P2P_PIPES"] = old
    return [res.steps[(0, s)].time for s in range(steps)], res, low


# ---- modes --------------------------------------------------------------------------------------
def mode_real(ranks: list[int], models: list[str], kinds: list[str], m: int, steps: int,
              rounds: int, warm: int, gloo: bool = False) -> None:
    print(f"real compute: bench MLP (width {WIDTH}, {BLOCKS} blocks, batch {BATCH}) and the "
          f"built-in transformer; gloo ranks {ranks}, m={m}, {steps} steps per run ({warm} "
          f"dropped), {rounds} A/B rounds; load average {_load()}")
    print("  medians; wall = step time (previous step's end to this one's, latest rank), "
          "cpu = the step's CPU time summed over the ranks")
    for model in models:
        for world in ranks:
            for kind in kinds:
                wall: dict[str, list[float]] = {"pipeir": [], "blocking": [], "torch": []}
                systems = [("pipeir", True, True), ("blocking", False, True)]
                if gloo:
                    wall["gloo"] = []
                    systems.append(("gloo", True, False))
                cpu: dict[str, list[float]] = {k: [] for k in wall}
                for _ in range(rounds):  # alternating: each system sees the same machine
                    for key, overlap, pipes in systems:
                        _, res, _ = run_pipeir(kind, world, m, steps, overlap, MODELS[model],
                                               pipes)
                        reps = [res.steps[(0, s)] for s in range(warm, steps)]  # type: ignore[attr-defined]
                        wall[key] += [r.time for r in reps]
                        cpu[key] += [r.cpu for r in reps]
                    try:
                        w, c = run_torch(kind, world, m, steps, MODELS[model])
                    except RuntimeError as e:  # torch's schedule refused the model
                        print(f"  {model:<11} p={world} {kind:<11} {e}", flush=True)
                        break
                    wall["torch"] += w[warm:]
                    cpu["torch"] += c[warm:]
                if not wall["torch"]:
                    continue
                mw = {k: statistics.median(v) * 1e3 for k, v in wall.items()}
                mc = {k: statistics.median(v) * 1e3 for k, v in cpu.items()}
                print(f"  {model:<11} p={world} {kind:<11} torch {mw['torch']:7.2f} ms "
                      f"(cpu {mc['torch']:7.2f})  pipeir {mw['pipeir']:7.2f} "
                      f"({mw['pipeir'] / mw['torch']:.2f}x; cpu {mc['pipeir'] / mc['torch']:.2f}x)"
                      f"  --blocking {mw['blocking']:7.2f} ({mw['blocking'] / mw['torch']:.2f}x; "
                      f"cpu {mc['blocking'] / mc['torch']:.2f}x)"
                      + (f"  gloo p2p {mw['gloo']:7.2f} ({mw['gloo'] / mw['torch']:.2f}x; "
                         f"cpu {mc['gloo'] / mc['torch']:.2f}x)" if gloo else ""), flush=True)


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def mode_sleep(world: int, m: int, steps: int) -> None:
    """Measured bubble against the simulator with the nominal costs (sleep times, free comm)
    and calibrated as `pipeirc run` does (measured op times, measured transfer time, the
    program's comm model)."""
    print(f"synthetic compute: F sleeps {SLEEP_F * 1e3:.0f} ms, B {SLEEP_B * 1e3:.0f} ms; "
          f"{world} ranks, m={m}, {steps} steps (first dropped)")
    for kind in ("1f1b", "interleaved"):
        sched = _schedule(kind, world, m)
        for overlap in (False, True):
            _, res, low = run_pipeir(kind, world, m, steps, overlap, f"{HERE}:sleep_spec")
            exp = expand_rounds(sched)
            times = [{r: res.times[(0, r, s)] for r in range(world)}  # type: ignore[attr-defined]
                     for s in range(1, steps)]
            measured_steps = [measured_result(low, exp, t) for t in times]  # type: ignore[arg-type]
            measured = statistics.median(x.bubble for x in measured_steps)
            nominal = simulate(sched, CostModel(F=SLEEP_F, B=SLEEP_B)).bubble
            latency = transfer_latency(low, times)  # type: ignore[arg-type]
            calibrated = calibrated_prediction(low, measured_steps, latency).bubble  # type: ignore[arg-type]
            print(f"  {kind:<12} overlap={overlap!s:<5} measured bubble {measured:6.1%}  "
                  f"simulated {nominal:6.1%} (x{measured / nominal:.2f})  calibrated "
                  f"{calibrated:6.1%} (x{measured / calibrated:.2f}, "
                  f"{latency * 1e3:.2f} ms/transfer)")


def _plain_noop_steps(steps: int) -> tuple[list[float], list[float]]:
    """The noop model trained by a plain loop: the work of a pipeir step written by hand
    (see the module docstring), with none of the runtime's bookkeeping. Wall and CPU time
    (this process's) of each step."""
    sp = noop_spec()
    mods = [NoopStage() for _ in range(NOOP_V)]
    opts = [sp.optimizer(m.parameters()) for m in mods]  # one per stage, as ModelSpec's
    wall, cpu = [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        x, y = sp.batch(step)
        for opt in opts:
            opt.zero_grad()
        for xm, ym in zip(torch.tensor_split(x, NOOP_M), torch.tensor_split(y, NOOP_M)):
            ins, outs = [], []
            h = xm
            for s, m in enumerate(mods):
                h = h.detach().requires_grad_(s > 0)  # a stage input, as a hand-off makes it
                ins.append(h)
                h = m(h)
                outs.append(h)
            root, grad = sp.loss(h, ym) * (1.0 / NOOP_M), None
            for s in reversed(range(NOOP_V)):  # one backward per stage, as the runtime's B
                torch.autograd.backward(root, grad)
                if s:
                    root, grad = outs[s - 1], ins[s].grad
        for opt in opts:
            opt.step()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def mode_noop(steps: int, rounds: int, warm: int) -> None:
    """pipeir's added cost per instruction (see the module docstring)."""
    torch.set_num_threads(1)
    low = pipeir.compile(pipeir.library.get("interleaved-1f1b", 1, NOOP_M, v=NOOP_V),
                         "").lowered
    instrs = len(low.program(0))
    job = Job(low, (rank_source(low, 0),), f"{HERE}:noop_spec", steps)
    wall: dict[str, list[float]] = {"pipeir": [], "plain": []}
    cpu: dict[str, list[float]] = {"pipeir": [], "plain": []}
    for _ in range(rounds):
        res = launch([job], 1, timeout_s=120)
        reps = [res.steps[(0, s)] for s in range(warm, steps)]
        wall["pipeir"] += [r.time for r in reps]
        cpu["pipeir"] += [r.cpu for r in reps]
        w, c = _plain_noop_steps(steps)
        wall["plain"] += w[warm:]
        cpu["plain"] += c[warm:]
    print(f"noop model: {NOOP_V} stages on 1 rank, m={NOOP_M}, {instrs} instructions per step, "
          f"{steps} steps per run ({warm} dropped), {rounds} rounds alternating; load average "
          f"{_load()}")
    for what, got in (("cpu", cpu), ("wall", wall)):
        med = {k: statistics.median(v) * 1e6 for k, v in got.items()}
        added = (med["pipeir"] - med["plain"]) / instrs
        print(f"  {what:<4}  pipeir {med['pipeir']:8.0f} us/step   plain loop {med['plain']:8.0f} "
              f"us/step   added {added:5.2f} us per instruction ({added * instrs / NOOP_M:6.1f} "
              "us per micro-batch)")


def _median_ms(fn: object, iters: int) -> float:
    assert callable(fn)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _stage_times(sp: ModelSpec, mod: nn.Module, inp: torch.Tensor, y: torch.Tensor,
                 last: bool, iters: int) -> tuple[float, ...]:
    """(F, B, I, W, old W) in ms; every backward runs on the graph of a fresh forward."""
    from pipeir.runtime import splitgrad

    def fwd() -> tuple[torch.Tensor, torch.Tensor]:
        i = inp.detach().requires_grad_(inp.is_floating_point())
        out = mod(i)
        return i, (sp.loss(out, y) if last else out)

    grad = None if last else torch.ones_like(fwd()[1])
    params = list(mod.parameters())

    def timed(run: object, split: bool = False) -> float:
        assert callable(run)
        times = []
        for _ in range(iters):
            i, o = fwd()
            arg = splitgrad.backward_input(o, grad, i)[1] if split else (i, o)
            t0 = time.perf_counter()
            run(arg)
            times.append(time.perf_counter() - t0)
            mod.zero_grad(set_to_none=True)
        return statistics.median(times) * 1e3

    return (_median_ms(fwd, iters),
            timed(lambda io: torch.autograd.backward(io[1], grad)),
            timed(lambda io: splitgrad.backward_input(io[1], grad, io[0])),
            timed(splitgrad.backward_weight, split=True),
            timed(lambda io: torch.autograd.grad(io[1], params, grad, allow_unused=True)))


def mode_ops(stages: int, iters: int) -> None:
    from pipeir.models import build_stage, resolve
    from pipeir.runtime.worker import split_batch

    torch.set_num_threads(1)
    print(f"op times (ms, median of {iters}), {stages} stages; micro-batch = 1/8 of the "
          "batch, or the whole batch for bench-mlp")
    for model, name, parts in (("mlp", "mlp", 8), ("transformer", "transformer", 8),
                               (f"{HERE}:spec", "bench-mlp", 1)):
        sp = resolve(model)
        x, y = (t[0] for t in split_batch(sp.batch(0), parts))
        h = x
        for s in range(stages):
            mod = build_stage(sp, s, stages)
            inp = h.detach().requires_grad_(h.is_floating_point())
            f, b, i, w, w_old = _stage_times(sp, mod, inp, y, s == stages - 1, iters)
            print(f"  {name:<12} stage {s}  F {f:6.3f}  B {b:6.3f}  I {i:6.3f}  W {w:6.3f}  "
                  f"I+W {i + w:6.3f} ({(i + w) / b:.2f} B)   old W {w_old:6.3f}")
            with torch.no_grad():
                h = mod(inp)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("real", "sleep", "ops", "noop", "both"), default="both",
                   help="what to measure (module docstring); both: real and sleep")
    p.add_argument("--ranks", type=_ints, default=[2, 4],
                   help="comma-separated rank counts for real mode (sleep and ops: the first)")
    p.add_argument("--models", default="mlp,transformer",
                   help=f"comma-separated models for real mode, of {', '.join(MODELS)}")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma-separated schedules for real mode, of {', '.join(KINDS)}")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gloo", action="store_true",
                   help="real mode: also pipeir with its transfers through gloo, as torch's "
                        "(PIPEIR_P2P_PIPES=off), not pipes")
    args = p.parse_args(argv)
    models, kinds = args.models.split(","), args.kinds.split(",")
    bad = [x for x in models if x not in MODELS] + [x for x in kinds if x not in KINDS]
    if bad:
        p.error(f"unknown model or schedule: {', '.join(bad)}")
    if args.mode in ("real", "both"):
        mode_real(args.ranks, models, kinds, args.microbatches, args.steps, args.rounds, warm=2,
                  gloo=args.gloo)
    if args.mode in ("sleep", "both"):
        mode_sleep(args.ranks[0], args.microbatches, 9)
    if args.mode == "ops":
        mode_ops(args.ranks[0], 200)
    if args.mode == "noop":
        mode_noop(max(args.steps, 40), args.rounds, warm=5)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
