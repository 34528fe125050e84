"""Dynamic micro-batch ordering (issue 7): fixed vs `reorder{by=cost}` entry order of 1F1B on
lognormal sequence lengths, and the time it takes to plan one step.

    python bench/reorder.py [--ranks 4,8] [--microbatches 16,32,64] [--seeds 5]
                            [--budget-ms 20] [--sigma 0.8] [--comm overlapped]

Costs: F = 1, B = 2 per micro-batch of the mean length, scaled by length (cost shape
a + b·len + c·len² with the default [0, 1], i.e. linear), latency 0.05. Lengths are
lognormal (median 512, sigma 0.8, clipped to [16, 8192]). "plan ms" is what re-planning a
training step costs when the schedule is fixed and only the lengths change: compiling the
schedule's structure with the new costs plus the search (`plan_order`), not building the
relabelled Schedule object. Every planned makespan is checked against `pipeir.sim.simulate`
on the relabelled schedule and against the fixed order (never worse). Figures are medians
over seeds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--microbatches", default="16,32,64")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budget-ms", type=float, default=20.0)
    ap.add_argument("--sigma", type=float, default=0.8)
    ap.add_argument("--comm", default="overlapped", choices=("overlapped", "blocking"))
    ap.add_argument("--schedule", default="1f1b")
    args = ap.parse_args(argv)

    import pipeir
    from pipeir.passes.reorder import plan_order, relabel
    from pipeir.sim import CostModel, simulate
    from pipeir.sim.lengths import lognormal_lengths

    print(f"{args.schedule}, lognormal lengths (sigma {args.sigma}), {args.comm} comm, "
          f"budget {args.budget_ms:g} ms, {args.seeds} seeds; medians")
    print(f"{'p':>3} {'m':>4} {'fixed':>9} {'reordered':>9} {'reduction':>9} {'worst':>7} "
          f"{'plan ms':>8} {'max ms':>7} {'evals':>6}")
    bad = 0
    for p in (int(x) for x in args.ranks.split(",")):
        for m in (int(x) for x in args.microbatches.split(",")):
            s = pipeir.library.get(args.schedule, ranks=p, microbatches=m)
            fixed, best, red, ms, evals = [], [], [], [], []
            for seed in range(args.seeds):
                lengths = lognormal_lengths(m, seed, sigma=args.sigma)
                costs = CostModel.from_settings({"F": 1.0, "B": 2.0, "latency": 0.05,
                                                 "lengths": tuple(lengths)})
                t0 = time.perf_counter()
                plan = plan_order(s, costs, comm=args.comm, budget_s=args.budget_ms / 1e3,
                                  evals=10**9, seed=seed)
                ms.append((time.perf_counter() - t0) * 1e3)
                check = simulate(relabel(s, plan.order), costs, comm=args.comm).makespan
                base = simulate(s, costs, comm=args.comm).makespan
                if check != plan.makespan or base != plan.fixed_makespan or check > base:
                    bad += 1
                fixed.append(base)
                best.append(check)
                red.append(1 - check / base)
                evals.append(plan.evaluations)
            print(f"{p:>3} {m:>4} {statistics.median(fixed):>9.1f} "
                  f"{statistics.median(best):>9.1f} {statistics.median(red):>9.1%} "
                  f"{min(red):>7.1%} {statistics.median(ms):>8.1f} {max(ms):>7.1f} "
                  f"{statistics.median(evals):>6.0f}")
    if bad:
        print(f"FAILED: {bad} plans disagree with the simulator or are worse than fixed",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
