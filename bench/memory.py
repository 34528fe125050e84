"""Memory benchmark: the recompute pass's choice against recomputing everything, and the
memory model with partial release against the runtime's measured peak.

    python bench/memory.py                  # 4 gloo ranks, 1F1B, m=8; then zb-h1
    python bench/memory.py --ranks 2 --microbatches 4 --steps 4
    python bench/memory.py --part split     # only the partial-release comparison

The budget is half of 1F1B's activation memory (the largest per-rank peak, in bytes, as
`pipeir.runtime.profile` measures each stage). Two schedules fit it: `recompute{budget=...}`
(the pass chooses which forwards to recompute and where) and `recompute{all=true}` (every
forward but the last stage's recomputed right before its backward: the peers' global switch).
Both are simulated (F and B at their sleep times) and run for real on gloo; the stage's
compute is a sleep inside an autograd function (so ranks do not fight over the cores and the
times are the costs), next to an MLP block whose activations are real. Printed: step
time, simulated and measured (median over the steps after the first, over alternating
rounds), by how much the pass is faster, and each rank's peak saved-activation bytes,
measured and simulated.

The split part profiles the built-in transformer (`pipeirc profile`, to a cost file: per stage
the bytes a forward saves and what W still needs after I, `memory_w_bytes`), runs ZB-H1 on it
(the runtime's I frees what W does not need), and prints each rank's peak saved-activation
bytes: measured (median over the steps of each step's peak), simulated from the profiled
cost file with the split, and simulated with everything held until W, each with its error.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import pipeir
from pipeir.backend.codegen import rank_source
from pipeir.models import ModelSpec, resolve
from pipeir.runtime.launch import launch
from pipeir.runtime.profile import cost_settings, profile_stages
from pipeir.runtime.worker import Job
from pipeir.sim import CostModel, simulate
from pipeir.verify import verify

HERE = Path(__file__).resolve()
WIDTH, BATCH = 128, 64
SLEEP_F, SLEEP_B = 0.010, 0.020  # seconds


class _SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(SLEEP_F)
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        time.sleep(SLEEP_B)
        return g


class _Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 8 * WIDTH)
        self.down = nn.Linear(8 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = _SleepFn.apply(self.down(torch.tanh(self.up(x))))
        return y


def spec() -> ModelSpec:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    return ModelSpec(stage=lambda s, n: _Stage(), loss=nn.functional.mse_loss, batch=batch)


def _costs(stages: int, m: int) -> CostModel:
    """Sleep times for F and B (ms), profiled bytes for memory."""
    measured = cost_settings(profile_stages(resolve(f"{HERE}:spec"), stages, m, 0, 1), None, {})
    settings: dict[str, object] = {"F": SLEEP_F * 1e3, "B": SLEEP_B * 1e3, "unit": "ms"}
    for s, level in measured["stage"].items():
        for k in ("memory_bytes", "input_bytes"):
            settings[f"stage.{s}.{k}"] = level[k]
    return CostModel.from_settings(settings)


def _run(schedule: pipeir.Schedule, steps: int) -> tuple[list[float], list[int]]:
    low = pipeir.compile(schedule).lowered
    job = Job(low, tuple(rank_source(low, r) for r in range(low.ranks)), f"{HERE}:spec", steps)
    res = launch([job], low.ranks, timeout_s=300)
    times = [res.steps[(0, s)].time for s in range(1, steps)]
    peaks = [max(res.saved_peak[(0, r, s)] for s in range(steps)) for r in range(low.ranks)]
    return times, peaks


def split(p: int, m: int, steps: int) -> bool:
    """ZB-H1 on the built-in transformer: measured peak bytes per rank against the profiled
    costs' prediction with and without partial release; True when every rank is within 10 %
    with the split."""
    model = "transformer"
    with tempfile.TemporaryDirectory() as tmp:  # what a user runs: profile, then its file
        path = Path(tmp) / f"{model}.json"
        subprocess.run([sys.executable, "-m", "pipeir", "profile", "--model", model, "--nproc",
                        str(p), "--microbatches", str(m), "-o", str(path)], check=True)
        costs = CostModel.load(path)
    whole = CostModel.from_settings({k: v for k, v in costs.settings().items()
                                     if not k.endswith("memory_w_bytes")})
    s = pipeir.library.get("zb-h1", p, m)
    low = pipeir.compile(s).lowered
    job = Job(low, tuple(rank_source(low, r) for r in range(low.ranks)), model, steps)
    res = launch([job], low.ranks, timeout_s=300)
    got = [statistics.median(res.saved_peak[(0, r, k)] for k in range(steps)) for r in range(p)]
    with_split = verify(s, sizes=costs).peak_bytes or ()
    held = verify(s, sizes=whole).peak_bytes or ()
    print(f"zb-h1, {model}, {p} gloo ranks, m={m}: peak saved-activation bytes per rank "
          "(measured: median over steps)")
    ok = True
    for r in range(p):
        a, b = with_split[r] / got[r] - 1, held[r] / got[r] - 1
        ok = ok and abs(a) <= 0.10
        print(f"  rank {r}: measured {got[r]:,.0f}  simulated with the split {with_split[r]:,.0f}"
              f" ({a:+.1%})  held until W {held[r]:,.0f} ({b:+.1%})")
    worst = max(abs(with_split[r] / got[r] - 1) for r in range(p))
    worst_whole = max(abs(held[r] / got[r] - 1) for r in range(p))
    print(f"largest error: {worst:.1%} with the split, {worst_whole:.1%} held until W")
    return ok


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--part", choices=("all", "recompute", "split"), default="all",
                    help="which comparison to run (default: both)")
    args = ap.parse_args(argv)
    p, m = args.ranks, args.microbatches
    split_ok = True
    if args.part in ("all", "split"):
        split_ok = split(p, m, args.steps)
        if args.part == "split":
            return 0 if split_ok else 1
    base = pipeir.library.get("1f1b", p, m)
    costs = _costs(p, m)
    full = verify(base, sizes=costs).peak_bytes or (0.0,)
    budget = max(full) / 2
    chosen = pipeir.compile(base, f"recompute{{budget={budget}}}", costs=costs).schedule
    every = pipeir.compile(base, "recompute{all=true}", costs=costs).schedule
    print(f"1F1B, {p} gloo ranks, m={m}: F sleeps {SLEEP_F * 1e3:.0f} ms, B {SLEEP_B * 1e3:.0f}"
          f" ms; 1F1B peaks at {max(full):.0f} bytes, budget {budget:.0f} bytes per rank")
    plans = {"recompute pass": chosen, "recompute all": every}
    sim = {k: simulate(s, costs).makespan for k, s in plans.items()}
    measured: dict[str, list[float]] = {k: [] for k in plans}
    peaks: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for k, s in plans.items():
            times, peaks[k] = _run(s, args.steps)
            measured[k] += times
    for k, s in plans.items():
        n = sum(op.kind == "RC" for op in s)
        sim_peak = verify(s, sizes=costs).peak_bytes or ()
        print(f"  {k:<15} {n:2d} recomputes  step: simulated {sim[k]:6.1f} ms, measured "
              f"{statistics.median(measured[k]) * 1e3:6.1f} ms")
        print(f"  {'':<15} peak bytes per rank: measured "
              f"{' '.join(str(b) for b in peaks[k])}; simulated "
              f"{' '.join(f'{b:.0f}' for b in sim_peak)}")
    a, b = statistics.median(measured["recompute pass"]), statistics.median(
        measured["recompute all"])
    sa, sb = sim["recompute pass"], sim["recompute all"]
    print(f"the pass's choice is faster than recomputing everything: measured {b / a:.3f}x "
          f"({(b - a) * 1e3:.1f} ms per step), simulated {sb / sa:.3f}x "
          f"({sb - sa:.1f} ms per step)")
    return 0 if a < b and sa < sb and split_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
