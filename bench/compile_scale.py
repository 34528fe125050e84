"""`pipeirc compile` and `check --lowered` as the pipeline grows, against torch's own generate +
lower + simulate of the same schedule, timed in the same run (issue 39: at p=64, v=4, m=512 —
262,144 ops — compile <= 0.3x torch and <= 1 KB of memory per op, under the default memory
budget, and generated code per rank that does not grow with m).

    python bench/compile_scale.py [--sizes 8,16,32,64] [--repeats 3] [--skip-torch]

Interleaved 1F1B, v=4, m=8p. Each measurement runs in a fresh subprocess, so its peak RSS is
its own; figures are medians over --repeats rounds, a round being one compile, one check and
one torch run back to back; compile/torch is the median of the rounds' ratios. Times are
in-process, after the imports and a small warm-up compile (the grammar and library caches),
of:
- compile: `pipeirc compile --schedule interleaved-1f1b ... -o DIR` (load, passes, verify,
  lowering, the communication proof, code generation, writing the files);
- check --lowered: `pipeirc check --lowered DIR/lowered.json` on what compile wrote;
- torch: ScheduleInterleaved1F1B's pipeline_order over mock stages (as
  `_schedule_visualizer.get_schedule_ops` builds it), `_add_send_recv` (its lowering) and
  `_simulate_comms_compute` (its deadlock check), on the same p, v, m.
Memory per op is the peak RSS during the measured work less the RSS before it, over the ops.
Generated code per rank: the largest rank<r>.py at p=8 with m=16 and m=256 (its
lowered.json, the data the ranks run, grows with m; the code does not).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

V = 4


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cli(argv: list[str]) -> None:
    from pipeir.cli import main

    with contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"pipeirc {' '.join(argv)}: exit {code}")


def _compile_argv(p: int, m: int, out: Path) -> list[str]:
    return ["compile", "--schedule", "interleaved-1f1b", "--ranks", str(p), "--microbatches",
            str(m), "--v", str(V), "-o", str(out), "--force"]


def one(what: str, p: int, m: int, out: Path) -> dict[str, float]:
    """One measurement in this process (run in a fresh one by `main`)."""
    if what == "torch":
        import warnings

        warnings.simplefilter("ignore")
        from simulate_scale import torch_pipeline_order
        from torch.distributed.pipelining.schedules import (
            _add_send_recv,
            _simulate_comms_compute,
        )

        torch_pipeline_order(2, 4, 2)  # warm up
        base = _rss_mib()
        t0 = time.perf_counter()
        order, n_stages = torch_pipeline_order(p, m, V)
        with_comms = _add_send_recv(order, lambda s: s % p, n_stages)
        _simulate_comms_compute(with_comms, lambda s: s % p, n_stages)
        t = time.perf_counter() - t0
        return {"s": t, "base_mib": base, "peak_mib": _rss_mib()}
    with tempfile.TemporaryDirectory() as tmp:
        _cli(_compile_argv(2, 4, Path(tmp) / "warm"))  # imports, grammar and library caches
        if what == "check":
            _cli(["check", "--lowered", str(Path(tmp) / "warm" / "lowered.json")])
    base = _rss_mib()
    t0 = time.perf_counter()
    if what == "compile":
        _cli(_compile_argv(p, m, out))
    else:
        _cli(["check", "--lowered", str(out / "lowered.json")])
    return {"s": time.perf_counter() - t0, "base_mib": base, "peak_mib": _rss_mib()}


def _fresh(what: str, p: int, m: int, out: Path) -> dict[str, float]:
    proc = subprocess.run([sys.executable, __file__, "--one", what, str(p), str(m), str(out)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} p={p} m={m} failed:\n{proc.stderr}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _code_size(p: int, m: int, tmp: Path) -> tuple[int, int]:
    """The largest rank<r>.py and lowered.json compiled at (p, m), in bytes."""
    out = tmp / f"code-{p}-{m}"
    _cli(_compile_argv(p, m, out))
    return (max(f.stat().st_size for f in out.glob("rank*.py")),
            (out / "lowered.json").stat().st_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,16,32,64", help="pipeline sizes p (m = 8p)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds (a fresh subprocess each for compile, check and torch); "
                         "medians are shown")
    ap.add_argument("--skip-torch", action="store_true", help="time pipeir only")
    ap.add_argument("--one", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        what, p, m, out = args.one
        print(json.dumps(one(what, int(p), int(m), Path(out))))
        return
    print(f"interleaved 1F1B, v={V}, m=8p; medians of {args.repeats} rounds (compile, check, "
          "torch back to back, a fresh process each; compile/torch: the median of the rounds' "
          "ratios); memory = peak RSS less RSS before the work\n")
    print(f"{'p':>3} {'m':>4} {'ops':>7} | {'compile s':>9} {'us/op':>6} {'B/op':>6} | "
          f"{'check s':>7} {'us/op':>6} {'B/op':>6} | {'torch s':>7} {'B/op':>6} | "
          f"{'compile/torch':>13}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for p in (int(x) for x in args.sizes.split(",")):
            m, ops = 8 * p, 8 * p * p * V * 2  # F and B per stage and micro-batch
            out = Path(tmp) / f"p{p}"
            # (a round is one of each, back to back: the machine's speed drifts between
            # rounds, and a ratio of two figures measured minutes apart carries the drift)
            rounds = [(_fresh("compile", p, m, out), _fresh("check", p, m, out),
                       None if args.skip_torch else _fresh("torch", p, m, out))
                      for _ in range(args.repeats)]
            comp, check = _median([r[0] for r in rounds]), _median([r[1] for r in rounds])
            torch = None if args.skip_torch else _median([r[2] for r in rounds if r[2]])

            def per_op(r: dict[str, float], ops: int = ops) -> float:
                return (r["peak_mib"] - r["base_mib"]) * 2**20 / ops

            ratio = statistics.median(c["s"] / t["s"] for c, _, t in rounds if t) if torch \
                else float("nan")
            rows.append({"p": p, "ops": ops, "compile": comp, "ratio": ratio,
                         "compile_b_op": per_op(comp)})
            t_cols = (f"{torch['s']:>7.2f} {per_op(torch):>6.0f}" if torch
                      else f"{'-':>7} {'-':>6}")
            print(f"{p:>3} {m:>4} {ops:>7} | {comp['s']:>9.2f} {1e6 * comp['s'] / ops:>6.1f} "
                  f"{per_op(comp):>6.0f} | {check['s']:>7.2f} {1e6 * check['s'] / ops:>6.1f} "
                  f"{per_op(check):>6.0f} | {t_cols} | {ratio:>12.2f}x", flush=True)
        small, large = _code_size(8, 16, Path(tmp)), _code_size(8, 256, Path(tmp))
    print(f"\ngenerated code per rank (p=8, largest rank<r>.py): {small[0]:,} B at m=16, "
          f"{large[0]:,} B at m=256 (lowered.json, the data: {small[1]:,} B and "
          f"{large[1]:,} B)")
    goal = next((r for r in rows if r["p"] == 64), None)
    if goal is not None:
        ok_t = goal["ratio"] <= 0.3
        ok_m = goal["compile_b_op"] <= 1024
        print(f"goal at p=64: compile <= 0.3x torch: {goal['ratio']:.2f}x "
              f"({'met' if ok_t else 'NOT met'}); <= 1 KB per op: "
              f"{goal['compile_b_op']:.0f} B ({'met' if ok_m else 'NOT met'})")


if __name__ == "__main__":
    main()
