"""Pipeline x data parallelism: where the gradient all-reduces go, measured and simulated.

    python bench/dp.py                 # sleep-compute mode (the check), then the MLP
    python bench/dp.py --mode sleep    # synthetic compute, real all-reduces of big gradients
    python bench/dp.py --mode real     # the built-in MLP

pp = 2 x dp = 2 (4 gloo processes). Each schedule runs twice: reductions placed by the pass
(`dp-reduce`, right after each stage's last weight gradient) and all at the end of the step
(`dp-reduce{at=end}`, nothing overlaps). For both, it prints the measured median step time, the
simulated step time (the simulator calibrated with the measured op times and the all-reduce
times measured in the at=end run, where every reduction is waited for in full), and how much
of the step waits for reductions (exposed), measured and simulated, and the hidden fraction of
the reduction time.

sleep: every forward sleeps F ms and every backward B ms (no CPU, so four processes do not
fight over two cores), and each stage holds a large parameter whose gradient really is
all-reduced; the exposed reduction time the simulator predicts must be within 10% of the
measured one (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import pipeir
from pipeir.backend.codegen import rank_source
from pipeir.models import ModelSpec
from pipeir.runtime.launch import RunResult, launch
from pipeir.runtime.measure import (
    allreduce_seconds,
    calibrated_prediction,
    expand_rounds,
    exposed_reduction,
    measured_result,
    transfer_latency,
)
from pipeir.runtime.worker import Job
from pipeir.schedule import Schedule

HERE = Path(__file__).resolve()
PP, DP = 2, 2
SLEEP_F, SLEEP_B = 0.010, 0.020  # seconds
PARAMS = 2_000_000  # floats per stage in sleep mode: an all-reduce of 8 MB
TOLERANCE = 0.10
args_verbose = False


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(SLEEP_F)
        return x * w

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        time.sleep(SLEEP_B)
        return g, g.sum(0)


class _Sleep(nn.Module):
    """Sleeps instead of computing; `bulk` is the stage's large parameter, which no op uses
    (so backwards cost no CPU) but whose (zero) gradient is all-reduced like any other."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))
        self.bulk = nn.Parameter(torch.zeros(PARAMS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepFn.apply(x, self.w)


def sleep_spec() -> ModelSpec:
    return ModelSpec(stage=lambda s, n: _Sleep(), loss=lambda y, t: ((y - t) ** 2).mean(),
                     batch=lambda step: (torch.zeros(32, 8), torch.zeros(32, 8)))


SCHEDULES = {
    "interleaved-1f1b v=2": ("interleaved-1f1b", {"v": 2}, ""),
    "1f1b + split-backward": ("1f1b", {}, "split-backward,"),
}


def _run(schedule: Schedule, passes: str, model: str, steps: int
         ) -> tuple[RunResult, pipeir.Schedule, object]:
    compiled = pipeir.compile(schedule, passes)
    low = compiled.lowered
    job = Job(low, tuple(rank_source(low, r) for r in range(low.ranks)), model, steps, dp=DP)
    return launch([job], PP * DP, timeout_s=120), compiled.schedule, low


def _measure(schedule: Schedule, passes: str, model: str, steps: int) -> dict[str, object]:
    res, compiled, low = _run(schedule, passes, model, steps)
    keep = range(2, steps)  # the first steps warm up
    every = [{g: res.times[(0, g, s)] for g in range(PP * DP)} for s in keep]
    replica0 = [{r: t[r * DP] for r in range(PP)} for t in every]
    exp = expand_rounds(compiled)
    measured = [measured_result(low, exp, t) for t in replica0]  # type: ignore[arg-type]
    return {"schedule": compiled, "lowered": low, "every": every, "measured": measured,
            "latency": transfer_latency(low, replica0),  # type: ignore[arg-type]
            "step": statistics.median(res.steps[(0, s)].time for s in keep),
            "exposed": statistics.median(exposed_reduction(low, t, DP) for t in every)}


def compare(mode: str, model: str, steps: int) -> bool:
    ok = True
    for name, (family, kw, split) in SCHEDULES.items():
        base = pipeir.library.get(family, PP, 4 * PP, **kw)
        end = _measure(base, f"{split}dp-reduce{{at=end}},overlap", model, steps)
        last = _measure(base, f"{split}dp-reduce,overlap", model, steps)
        reduce = allreduce_seconds(end["lowered"], end["every"], DP)  # type: ignore[arg-type]
        total = sum(reduce.values())
        print(f"  {name}: all-reduce per stage (measured with nothing to overlap) "
              + ", ".join(f"s{s} {t * 1e3:.1f} ms" for s, t in reduce.items()))
        for label, got in (("at end", end), ("by the pass", last)):
            sim = calibrated_prediction(got["lowered"], got["measured"],  # type: ignore[arg-type]
                                        got["latency"], reduce, DP)  # type: ignore[arg-type]
            exposed, sim_exposed = got["exposed"], sim.exposed_reduction
            busiest = sim.reduction_time
            hidden = 1 - min(1.0, exposed / busiest) if busiest else 1.0  # type: ignore[operator]
            err = abs(sim_exposed - exposed) / max(exposed, 1e-9)  # type: ignore[operator]
            line = (f"    {label:<12} step measured {got['step'] * 1e3:7.1f} ms, simulated "  # type: ignore[operator]
                    f"{sim.makespan * 1e3:7.1f} ms; reductions {total * 1e3:5.1f} ms, exposed "
                    f"measured {exposed * 1e3:5.1f} ms, simulated {sim_exposed * 1e3:5.1f} ms "  # type: ignore[operator]
                    f"({err:.0%} apart); hidden {hidden:.0%} measured, "
                    f"{sim.hidden_reduction:.0%} simulated")
            print(line)
            if args_verbose:
                print("      measured exposed per step (ms): " + " ".join(
                    f"{exposed_reduction(got['lowered'], t, DP) * 1e3:.1f}"  # type: ignore[arg-type]
                    for t in got["every"]))  # type: ignore[attr-defined]
            if mode == "sleep" and exposed > 0.002 and err > TOLERANCE:  # type: ignore[operator]
                ok = False
    return ok


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("sleep", "real", "both"), default="both")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    ok = True
    if args.mode in ("sleep", "both"):
        print(f"sleep compute (F {SLEEP_F * 1e3:.0f} ms, B {SLEEP_B * 1e3:.0f} ms), "
              f"{PARAMS * 4 / 1e6:.0f} MB of gradients per stage; pp={PP} x dp={DP}, "
              f"m={4 * PP}, overlap, {args.steps} steps (2 dropped)")
        ok = compare("sleep", f"{HERE}:sleep_spec", args.steps)
        print("  check: simulated exposed reduction time within "
              f"{TOLERANCE:.0%} of the measured one: {'ok' if ok else 'FAILED'}")
    if args.mode in ("real", "both"):
        print(f"built-in mlp; pp={PP} x dp={DP}, m={4 * PP}, overlap, {args.steps} steps")
        compare("real", "mlp", args.steps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
