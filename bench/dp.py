"""Pipeline x data parallelism: where the gradient all-reduces go, measured and simulated.

    python bench/dp.py                 # sleep-compute mode (the check), then the MLP
    python bench/dp.py --mode sleep    # synthetic compute, real all-reduces of big gradients
    python bench/dp.py --mode real     # the built-in MLP

pp = 2 x dp = 2 (4 gloo processes), schedules with two stages per rank (the only ones where
placement matters: with one stage per rank its last weight gradient is the rank's last op,
so `dp-reduce` puts the reduction at the end anyway). Each schedule runs with the reductions
placed by the pass (`dp-reduce`, right after each stage's last weight gradient) and all at
the end of the step (`dp-reduce{at=end}`, nothing overlaps), `--repeats` times each,
alternating, in one launch (so both see the same machine). For both it prints the median
step time over every kept step of every repeat, measured and simulated, and how much of the
step waits for reductions (exposed: when the last all-reduce finished minus the end of the
last compute op, over all ranks, on both sides), measured and simulated, and the hidden
fraction; and whether the pass's step is shorter, overall and in each back-to-back pair.

Each kept step is simulated with what that step measured: the mean time per stage and op kind,
the transfer time, and each stage's all-reduce time (from the end of the compute before its
post, or the previous all-reduce's finish, on the replica that got there last, to when it
finished: `pipeir.runtime.measure.allreduce_seconds`, from the finish times the gloo work
objects record). For the pass it also prints, unchecked, the prediction from the at-end runs'
all-reduce times instead (off by how much an all-reduce's time depends on what else runs).

sleep: every forward sleeps F ms and every backward B ms (no CPU, so four processes do not
fight over two cores), and each stage holds a large parameter whose gradient really is
all-reduced. Checks (exit 1 otherwise): the exposed reduction time the simulator predicts is
within 10% of the measured one, and the pass's median step is not slower than at-end's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import torch
from torch import nn

import pipeir
from pipeir.backend.codegen import rank_source
from pipeir.backend.instructions import Lowered
from pipeir.models import ModelSpec
from pipeir.runtime.launch import launch
from pipeir.runtime.measure import (
    Reduced,
    Times,
    allreduce_seconds,
    calibrated_prediction,
    expand_rounds,
    exposed_reduction,
    measured_result,
    transfer_latency,
)
from pipeir.runtime.worker import Job
from pipeir.schedule import Schedule
from pipeir.sim import SimResult

sys.path.insert(0, str(Path(__file__).resolve().parent))  # in the ranks too: they import this file
from runtime import SLEEP_B, SLEEP_F, SleepStage

HERE = Path(__file__).resolve()
PP, DP = 2, 2
PARAMS = 4_000_000  # floats per stage in sleep mode: an all-reduce of 16 MB
TOLERANCE = 0.10
WARMUP = 2  # steps dropped from each run


class _Sleep(SleepStage):
    """bench/runtime.py's sleeping stage plus `bulk`, the stage's large parameter, which no op
    uses (so backwards cost no CPU) but whose (zero) gradient is all-reduced like any other."""

    def __init__(self) -> None:
        super().__init__()
        self.bulk = nn.Parameter(torch.zeros(PARAMS))


def sleep_spec() -> ModelSpec:
    return ModelSpec(stage=lambda s, n: _Sleep(), loss=lambda y, t: ((y - t) ** 2).mean(),
                     batch=lambda step: (torch.zeros(32, 8), torch.zeros(32, 8)))


SCHEDULES = {
    "interleaved-1f1b v=2": ("interleaved-1f1b", {"v": 2}, ""),
    "zb-v (split I/W)": ("zb-v", {}, ""),
}
PLACEMENTS = {"at end": "dp-reduce{at=end}", "by the pass": "dp-reduce"}


@dataclass
class Runs:
    """The kept steps of every repeat of one schedule and placement."""

    lowered: Lowered
    schedule: Schedule
    every: list[dict[int, Times]] = field(default_factory=list)  # all P x D ranks, by step
    reduced: list[Reduced] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)

    def replica0(self) -> list[dict[int, Times]]:
        return [{r: t[r * DP] for r in range(PP)} for t in self.every]

    def exposed(self) -> list[float]:
        return [exposed_reduction(self.lowered, t, DP, r)
                for t, r in zip(self.every, self.reduced)]

    def allreduce(self) -> dict[int, float]:
        """Each stage's all-reduce time in these runs (median)."""
        return allreduce_seconds(self.lowered, self.every, self.reduced, DP)

    def predictions(self, reduce: dict[int, float] | None = None) -> list[SimResult]:
        """Per kept step, the simulator's prediction with that step's measured op, transfer
        and all-reduce times, or the all-reduce times `reduce` (one simulation per step: the
        exposed time is a maximum over paths, so simulating median times would not give the
        median step's exposure)."""
        exp = expand_rounds(self.schedule)
        out = []
        for every, done, mine in zip(self.every, self.reduced, self.replica0()):
            measured = [measured_result(self.lowered, exp, mine)]
            red = (allreduce_seconds(self.lowered, [every], [done], DP) if reduce is None
                   else reduce)
            out.append(calibrated_prediction(self.lowered, measured,
                                             transfer_latency(self.lowered, [mine]), red, DP))
        return out


def measure(model: str, steps: int, repeats: int) -> dict[tuple[str, str], Runs]:
    """Every schedule and placement, `repeats` times, alternating, in one launch."""
    runs: dict[tuple[str, str], Runs] = {}
    jobs, keys = [], []
    for name, (family, kw, split) in SCHEDULES.items():
        base = pipeir.library.get(family, PP, 4 * PP, **kw)
        for label, reduce in PLACEMENTS.items():
            compiled = pipeir.compile(base, f"{split}{reduce},overlap")
            runs[name, label] = Runs(compiled.lowered, compiled.schedule)
    for k in range(repeats):
        order = list(runs) if k % 2 == 0 else list(reversed(runs))
        for key in order:
            low = runs[key].lowered
            sources = tuple(rank_source(low, r) for r in range(low.ranks))
            jobs.append(Job(low, sources, model, steps, dp=DP))
            keys.append(key)
    res = launch(jobs, PP * DP, timeout_s=60 * len(jobs))
    for j, key in enumerate(keys):
        got = runs[key]
        for s in range(WARMUP, steps):
            got.every.append({g: res.times[(j, g, s)] for g in range(PP * DP)})
            got.reduced.append({g: res.reduced.get((j, g, s), []) for g in range(PP * DP)})
            got.step_times.append(res.steps[(j, s)].time)
    return runs


def compare(mode: str, model: str, steps: int, repeats: int) -> bool:
    ok = True
    runs = measure(model, steps, repeats)
    for name in SCHEDULES:
        print(f"  {name}:")
        step = {}
        for label in PLACEMENTS:
            got = runs[name, label]
            reduce = got.allreduce()
            sims = got.predictions()
            exposed, sim_exposed = median(got.exposed()), median(r.exposed_reduction for r in sims)
            busiest = median(r.reduction_time for r in sims)
            step[label] = median(got.step_times)
            err = abs(sim_exposed - exposed) / max(exposed, 1e-9)
            close = exposed <= 0.002 or err <= TOLERANCE
            print(f"    {label:<12} all-reduce per stage (measured in the run) "
                  + ", ".join(f"s{s} {t * 1e3:.1f}" for s, t in reduce.items()) + " ms")
            print(f"    {'':<12} step {step[label] * 1e3:6.1f} ms measured, "
                  f"{median(r.makespan for r in sims) * 1e3:6.1f} simulated; exposed reduction "
                  f"{exposed * 1e3:5.1f} ms measured, {sim_exposed * 1e3:5.1f} simulated "
                  f"({err:.0%} apart{'' if close else ', over 10%'}); hidden "
                  f"{_hidden(exposed, busiest):.0%} measured, "
                  f"{_hidden(sim_exposed, busiest):.0%} simulated")
            if label == "by the pass":  # out of sample: at-end's all-reduce times
                cross = median(r.exposed_reduction
                               for r in got.predictions(runs[name, "at end"].allreduce()))
                print(f"    {'':<12} with the at-end runs' all-reduce times instead: "
                      f"{cross * 1e3:.1f} ms simulated "
                      f"({abs(cross - exposed) / max(exposed, 1e-9):.0%} apart; not checked)")
            if mode == "sleep" and not close:
                ok = False
        gain = step["at end"] - step["by the pass"]
        faster = gain >= 0
        n = steps - WARMUP
        pairs = [median(runs[name, "at end"].step_times[k * n:(k + 1) * n])
                 - median(runs[name, "by the pass"].step_times[k * n:(k + 1) * n])
                 for k in range(repeats)]
        print(f"    the pass vs at end: step {abs(gain) * 1e3:.1f} ms "
              f"{'shorter' if faster else 'LONGER'} (medians over {len(got.step_times)} "
              f"steps each: {repeats} runs x {n} steps); shorter in "
              f"{sum(d > 0 for d in pairs)} of {repeats} back-to-back pairs of runs")
        if mode == "sleep" and not faster:
            ok = False
    return ok


def _hidden(exposed: float, total: float) -> float:
    """The fraction of the busiest rank's reduction time `total` that `exposed` leaves hidden."""
    return 1 - min(1.0, exposed / total) if total else 1.0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("sleep", "real", "both"), default="both")
    p.add_argument("--steps", type=int, default=8, help=f"per run ({WARMUP} dropped)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each schedule and placement")
    args = p.parse_args(argv)
    ok = True
    if args.mode in ("sleep", "both"):
        print(f"sleep compute (F {SLEEP_F * 1e3:.0f} ms, B {SLEEP_B * 1e3:.0f} ms), "
              f"{PARAMS * 4 / 1e6:.0f} MB of gradients per stage; pp={PP} x dp={DP}, "
              f"m={4 * PP}, overlap")
        ok = compare("sleep", f"{HERE}:sleep_spec", args.steps, args.repeats)
        print(f"  check: simulated exposed reduction within {TOLERANCE:.0%} of the measured "
              f"one, the pass not slower than at end: {'ok' if ok else 'FAILED'}")
    if args.mode in ("real", "both"):
        print(f"built-in mlp; pp={PP} x dp={DP}, m={4 * PP}, overlap")
        compare("real", "mlp", args.steps, args.repeats)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
