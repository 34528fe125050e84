"""Start-up benchmark: time to the first training step of `pipeirc run` against an
equivalent torchrun + torch.distributed.pipelining script.

    python bench/startup.py [--ranks 2] [--microbatches 4] [--rounds 5]

Both train the built-in `mlp` (width 512, 8 blocks, batches of 256, SGD with momentum) with
1F1B, one stage per rank, on gloo: pipeir as `pipeirc run --schedule 1f1b --ranks P
--model mlp --steps 1` (compile, model checks, starting the ranks, the step), torch as
`torchrun --nproc-per-node P bench/startup_kit/torch_1f1b.py` (the same model and data written
with torch only); both as `python -m` (pipeir, torch.distributed.run: what the two console
scripts run). Each is a fresh command; the clock runs from starting it to the line its
first step prints (pipeir's `step    1/1`, the torch script's `step 1`). Runs alternate
(pipeir, torch, pipeir, ...) so both see the same machine load; the figures are medians over
the rounds and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

KIT = Path(__file__).resolve().parent / "startup_kit"


def first_step(cmd: list[str], marker: str, timeout_s: float = 300) -> float:
    """Seconds from starting `cmd` to the first output line starting with `marker` (the
    command then runs to its end; a failure or no such line is an error)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
    return got


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    pipeir = [sys.executable, "-m", "pipeir", "run", "--schedule", "1f1b", "--ranks",
              str(args.ranks), "--microbatches", str(args.microbatches), "--model", "mlp",
              "--steps", "1"]
    torch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
             str(args.ranks), str(KIT / "torch_1f1b.py"), "--microbatches",
             str(args.microbatches), "--steps", "1"]
    got: dict[str, list[float]] = {"pipeir": [], "torch": []}
    for r in range(args.rounds):
        got["pipeir"].append(first_step(pipeir, "step    1/"))
        got["torch"].append(first_step(torch, "step 1"))
        print(f"  round {r + 1}: pipeirc run {got['pipeir'][-1]:6.2f} s   torchrun + torch "
              f"{got['torch'][-1]:6.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"time to the first step, {args.ranks} ranks, mlp, 1f1b, m={args.microbatches}, "
          f"median of {args.rounds} alternating rounds: pipeirc run {med['pipeir']:.2f} s, "
          f"torchrun + torch {med['torch']:.2f} s, ratio {med['pipeir'] / med['torch']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
