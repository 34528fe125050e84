"""Schedule synthesis (issue 15): tune's best library schedule, the Zero Bubble paper's greedy
scheduler and `synth` side by side, per cost file, at 1F1B's memory and at twice it.

    python bench/synth.py [--repeat 3] [--rows NAME,...] [--workers 2] [--quick]

Columns: the memory budget K (micro-batches of one stage per rank; 1F1B needs P); tune: the
fastest library schedule with passes at the same P, M and K (`pipeir.search.tune.search`, overlapped
communication) and its step; zb: the re-implemented Zero Bubble greedy scheduler
(`pipeir.search.synth.zb_greedy`, one stage per rank, I + W, at K); synth: `synth(..., v=None,
split=True)` (shapes 1, 2, 4 loop/V and tune's best, I + W), its step, the proven lower bound,
the gap and the wall time; vs tune: how much faster synth is. Every step is the simulator's
(`pipeir.simulate` of the emitted schedule). Steps, bounds and times are medians over
--repeat runs with seeds 0, 1, 2...; the goals of issue 15 are checked at the end. A second
table solves one fixed shape (one stage per rank, I + W), where the model can close the gap.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

COSTS = Path(__file__).parent.parent / "examples" / "costs"


@dataclass(frozen=True)
class Row:
    name: str
    costs: str
    ranks: int
    microbatches: int
    time_limit: float
    heterogeneous: bool


ROWS = (
    Row("uniform-4", "uniform.toml", 4, 8, 60, False),
    Row("heavy-ends-4", "heavy-ends.toml", 4, 8, 60, True),
    Row("compute-bound-4", "compute-bound.toml", 4, 8, 60, True),
    Row("h100-llama-8", "h100-llama.toml", 8, 32, 120, True),
    Row("uniform-16", "uniform.toml", 16, 64, 120, False),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="a tenth of every time limit")
    args = ap.parse_args(argv)

    from pipeir.search.synth import make_problem, synth
    from pipeir.search.synth.zb_greedy import zb_greedy
    from pipeir.search.tune import search
    from pipeir.sim import CostModel, simulate
    from pipeir.verify import verify

    wanted = args.rows.split(",")
    head = (f"{'costs':<16} {'P':>2} {'M':>3} {'K':>3}  {'tune best':<44} {'tune':>8} "
            f"{'zb':>8} {'synth':>8} {'bound':>8} {'gap':>6} {'time s':>6}  {'vs tune':>7}"
            f"  synth's shape")
    print(head)
    print("-" * len(head))
    failures = []
    for row in (r for r in ROWS if r.name in wanted):
        costs = CostModel.load(COSTS / row.costs)
        p, m = row.ranks, row.microbatches
        limit = row.time_limit / (10 if args.quick else 1)
        for k in (p, 2 * p):
            tuned = search(costs, p, [m], memory_limit=k, comms=("overlapped",)).best
            zb_problem = make_problem(costs, p, m, split=True, memory_limit=k)
            zb = zb_greedy(zb_problem)
            zb_step = zb_problem.step_time(zb) if zb is not None else float("nan")
            steps, bounds, walls, shape = [], [], [], ""
            for seed in range(args.repeat):
                t0 = time.perf_counter()
                r = synth(costs, p, m, v=None, split=True, memory_limit=k, time_limit=limit,
                          workers=args.workers, seed=seed)
                walls.append(time.perf_counter() - t0)
                verify(r.schedule)
                assert r.problem.fits(r.schedule)
                assert simulate(r.schedule, r.problem.costs).makespan == r.step
                steps.append(r.step)
                bounds.append(r.bound)
                c = r.problem.config
                shape = f"v={c.stages // p} {c.placement_name}, {r.method.split(':')[0]}"
            step, bound = statistics.median(steps), statistics.median(bounds)
            gap = 1 - bound / step if step > 0 else 0.0
            gain = 1 - step / tuned.step_time
            label = tuned.family + (f" v={tuned.v}" if tuned.v > 1 else "") + \
                (f" {tuned.passes}" if tuned.passes else "")
            print(f"{row.costs[:-5]:<16} {p:>2} {m:>3} {k:>3}  {label:<44} "
                  f"{tuned.step_time:>8.5g} {zb_step:>8.5g} {step:>8.5g} {bound:>8.5g} "
                  f"{gap:>6.1%} {statistics.median(walls):>6.1f}  {gain:>7.1%}  {shape}",
                  flush=True)
            failures += _goals(row, k, tuned.step_time, zb_step, step, gap,
                               statistics.median(walls), limit)
    print()
    print("one shape (v = 1, I + W): how close the model gets to a proof")
    print(f"{'costs':<16} {'P':>2} {'M':>3} {'K':>3} {'synth':>8} {'bound':>8} {'gap':>6} "
          f"{'time s':>6}")
    for name, p, m, k, limit in EXACT:
        if args.quick:
            limit /= 10
        costs = CostModel.load(COSTS / name)
        runs = [synth(costs, p, m, v=1, split=True, memory_limit=k, time_limit=limit,
                      workers=args.workers, seed=seed) for seed in range(args.repeat)]
        step = statistics.median(r.step for r in runs)
        bound = statistics.median(r.bound for r in runs)
        wall = statistics.median(r.wall for r in runs)
        gap = 1 - bound / step
        print(f"{name[:-5]:<16} {p:>2} {m:>3} {k:>3} {step:>8.5g} {bound:>8.5g} {gap:>6.1%} "
              f"{wall:>6.1f}", flush=True)
        if (p, m) == (4, 8) and gap > 0:
            failures.append(f"{name} p=4 m=8 v=1 K={k}: gap {gap:.1%}")
        if (p, m) == (8, 32) and gap > 0.05:
            failures.append(f"{name} p=8 m=32 v=1 K={k}: gap {gap:.1%}")
    print()
    print("goals: " + ("all met" if not failures else "; ".join(failures)))
    return 0


#: (cost file, P, M, K, seconds): the exactness goals on one fixed shape
EXACT = (("heavy-ends.toml", 4, 8, 4, 60.0), ("heavy-ends.toml", 4, 8, 8, 60.0),
         ("h100-llama.toml", 8, 32, 8, 120.0))


def _goals(row: Row, k: int, tune: float, zb: float, step: float, gap: float, wall: float,
           limit: float) -> list[str]:
    """Issue 15's 'done when', for one row."""
    out = []
    where = f"{row.name} K={k}"
    if step > tune * (1 + 1e-9):
        out.append(f"{where}: slower than tune")
    if row.heterogeneous and k == row.ranks and step > tune * 0.97:
        out.append(f"{where}: less than 3% faster than tune ({1 - step / tune:.1%})")
    if zb == zb and step > zb * (1 + 1e-9):
        out.append(f"{where}: slower than the ZB heuristic")
    if (row.ranks, row.microbatches) == (4, 8) and gap > 0:
        out.append(f"{where}: gap {gap:.1%} (want 0 within {limit:g} s)")
    if (row.ranks, row.microbatches) == (8, 32) and gap > 0.05:
        out.append(f"{where}: gap {gap:.1%} (want <= 5%)")
    if wall > limit * 1.1 + 15:
        out.append(f"{where}: took {wall:.0f} s")
    return out


if __name__ == "__main__":
    sys.exit(main())
