"""Build + verify time of interleaved 1F1B as the pipeline grows (issue: ≤ 2 s at p=32, v=4,
m=256 — 65,536 compute ops — growing linearly), against torch.distributed.pipelining's own
generator for the same schedule, timed in the same run.

    python bench/compile_scale.py [--sizes 8,16,32,64] [--repeats 3]

Each size runs in a fresh subprocess so its peak RSS is its own. Figures are medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

V = 4


def measure(p: int, repeats: int) -> dict[str, float]:
    import resource

    import pipeir

    m = 8 * p
    pipeir.library.get("interleaved-1f1b", 2, 4, v=2)  # warm the grammar and library caches
    build, check = [], []
    n_ops = 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        s = pipeir.library.get("interleaved-1f1b", p, m, v=V)
        t1 = time.perf_counter()
        pipeir.verify(s)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        check.append(t2 - t1)
        n_ops = len(s)
        del s
    torch_t = []
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

        for _ in range(repeats):
            t0 = time.perf_counter()
            get_schedule_ops("Interleaved1F1B", p, m, num_stages_per_rank=V)
            torch_t.append(time.perf_counter() - t0)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"p": p, "m": m, "v": V, "ops": n_ops, "build_s": statistics.median(build),
            "verify_s": statistics.median(check), "torch_generate_s": statistics.median(torch_t),
            "peak_rss_mib": rss_mib}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,16,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.repeats)))
        return
    print(f"interleaved 1F1B, v={V}, m=8p; medians of {args.repeats} runs per size\n")
    print(f"{'p':>4} {'m':>5} {'ops':>8} {'build s':>8} {'verify s':>9} {'total s':>8} "
          f"{'us/op':>6} {'torch gen s':>11} {'torch/pipeir':>12} {'peak RSS MiB':>12}")
    rows = []
    for p in (int(x) for x in args.sizes.split(",")):
        out = subprocess.run([sys.executable, __file__, "--one", str(p), "--repeats",
                              str(args.repeats)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        total = r["build_s"] + r["verify_s"]
        rows.append((r, total))
        print(f"{r['p']:>4} {r['m']:>5} {r['ops']:>8} {r['build_s']:>8.3f} {r['verify_s']:>9.3f} "
              f"{total:>8.3f} {1e6 * total / r['ops']:>6.1f} {r['torch_generate_s']:>11.3f} "
              f"{r['torch_generate_s'] / total:>11.2f}x {r['peak_rss_mib']:>12.0f}")
    goal = [t for r, t in rows if r["p"] == 32]
    if goal:
        print(f"\ngoal: build + verify at p=32, v=4, m=256 <= 2 s: {goal[0]:.3f} s "
              f"({'met' if goal[0] <= 2 else 'NOT met'})")


if __name__ == "__main__":
    main()
