"""Entry point of generated `main.py` under torchrun: one process per rank, env:// init.

    torchrun --nproc-per-node P DIR/main.py [--model mlp] [--steps 20] [--timeout 60]

The rank that owns the last stage writes one line per step (loss and step time) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from pipeir.backend.lower import from_json
from pipeir.runtime.worker import Job, run_rank


def main(directory: Path, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="main.py", description="run a compiled pipeir program")
    p.add_argument("--model", default="mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        sys.stderr.write("main.py: start me with torchrun --nproc-per-node P main.py\n")
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lowered = from_json(json.loads((directory / "lowered.json").read_text()))
    if world != lowered.ranks:
        sys.stderr.write(f"main.py: compiled for {lowered.ranks} ranks, started with {world}\n")
        return 2
    sources = tuple((directory / f"rank{r}.py").read_text() for r in range(world))
    job = Job(lowered, sources, args.model, args.steps)

    def emit(msg: tuple[Any, ...]) -> None:
        if msg[0] == "step" and msg[4] is not None:
            _, _, _, step, loss, t0, t1, _, _ = msg
            sys.stdout.write(f"step {step + 1}/{args.steps}  loss {loss:.5f}  "
                             f"{(t1 - t0) * 1e3:.1f} ms\n")
            sys.stdout.flush()

    run_rank(rank, world, "env://", [job], emit, lambda job, pc: None, args.timeout)
    return 0
