"""Start-up benchmark: time to the first training step of `pipeirc run` against an
equivalent torchrun + torch.distributed.pipelining script.

    python bench/startup.py [--ranks 2] [--microbatches 4] [--rounds 5] [--breakdown]

Both train the built-in `mlp` (width 512, 8 blocks, batches of 256, SGD with momentum) with
1F1B, one stage per rank, on gloo: pipeir as `pipeirc run --schedule 1f1b --ranks P
--model mlp --steps 1` (compile, model checks, starting the ranks, the step), torch as
`torchrun --nproc-per-node P bench/startup_kit/torch_1f1b.py` (the same model and data written
with torch only); both as `python -m` (pipeir, torch.distributed.run: what the two console
scripts run). Each is a fresh command; the clock runs from starting it to the line its
first step prints (pipeir's `step    1/1`, the torch script's `step 1`). Runs alternate
(pipeir, torch, pipeir, ...) so both see the same machine load; the figures are medians over
the rounds and their ratio, each round with the 1-minute load average before it.

`--breakdown` also says where the time goes: every process of both commands appends its
start-up milestones to a file (PIPEIR_MILESTONES, pipeir.runtime.milestones), and the bench
prints, per milestone, the median over the rounds of the seconds from starting the command
(a rank milestone: when the last rank passed it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent / "startup_kit"
ENV = "PIPEIR_MILESTONES"  # pipeir.runtime.milestones.ENV, spelt out: the bench imports no pipeir


def first_step(cmd: list[str], marker: str, milestones: Path | None = None,
               timeout_s: float = 300) -> tuple[float, dict[str, float]]:
    """Seconds from starting `cmd` to the first output line starting with `marker` (the
    command then runs to its end; a failure or no such line is an error), and with
    `milestones` (a file) the seconds from the start to each milestone the command's
    processes wrote there."""
    env = dict(os.environ)
    if milestones is not None:
        milestones.write_text("")
        env[ENV] = str(milestones)
    start = time.time()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    got, lines = None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if got is None and line.lstrip("\r").startswith(marker):
            got = time.perf_counter() - t0
    code = proc.wait(timeout_s)
    if code != 0 or got is None:
        raise SystemExit(f"{' '.join(cmd)} exited {code} without `{marker}`:\n"
                         + "".join(lines[-20:]))
    return got, ({} if milestones is None else _read(milestones, start))


def _read(path: Path, start: float) -> dict[str, float]:
    """milestone -> seconds from `start`; `rank R: name` lines become `ranks: name`, when the
    last rank passed it."""
    out: dict[str, float] = {}
    for line in path.read_text().splitlines():
        when, _pid, name = line.split(" ", 2)
        if name.startswith("rank "):
            name = "ranks: " + name.split(": ", 1)[1]
        out[name] = max(out.get(name, 0.0), float(when) - start)
    return out


def _table(title: str, rounds: list[dict[str, float]], total: float) -> None:
    names = sorted({n for r in rounds for n in r},
                   key=lambda n: statistics.median(r[n] for r in rounds if n in r))
    print(f"{title} (seconds from starting the command, median over {len(rounds)} rounds; "
          "ranks: the last rank)")
    prev = 0.0
    for n in names:
        t = statistics.median(r[n] for r in rounds if n in r)
        print(f"  {t:6.2f}  (+{t - prev:5.2f})  {n}")
        prev = t
    print(f"  {total:6.2f}  (+{total - prev:5.2f})  first step's line read")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--breakdown", action="store_true",
                   help="also print where the time to the first step goes (milestones)")
    args = p.parse_args(argv)
    pipeir = [sys.executable, "-m", "pipeir", "run", "--schedule", "1f1b", "--ranks",
              str(args.ranks), "--microbatches", str(args.microbatches), "--model", "mlp",
              "--steps", "1"]
    torch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
             str(args.ranks), str(KIT / "torch_1f1b.py"), "--microbatches",
             str(args.microbatches), "--steps", "1"]
    got: dict[str, list[float]] = {"pipeir": [], "torch": []}
    marks: dict[str, list[dict[str, float]]] = {"pipeir": [], "torch": []}
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "milestones" if args.breakdown else None
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name, cmd, marker in (("pipeir", pipeir, "step    1/"),
                                      ("torch", torch, "step 1")):
                t, m = first_step(cmd, marker, file)
                got[name].append(t)
                marks[name].append(m)
            print(f"  round {r + 1}: pipeirc run {got['pipeir'][-1]:6.2f} s   torchrun + torch "
                  f"{got['torch'][-1]:6.2f} s   ratio "
                  f"{got['pipeir'][-1] / got['torch'][-1]:.2f}   load {loads[-1]:.1f}",
                  flush=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    if args.breakdown:
        _table("pipeirc run", marks["pipeir"], med["pipeir"])
        _table("torchrun + torch", marks["torch"], med["torch"])
    print(f"time to the first step, {args.ranks} ranks, mlp, 1f1b, m={args.microbatches}, "
          f"median of {args.rounds} alternating rounds: pipeirc run {med['pipeir']:.2f} s, "
          f"torchrun + torch {med['torch']:.2f} s, ratio {med['pipeir'] / med['torch']:.2f} "
          f"(load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
