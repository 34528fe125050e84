"""Start-up milestones, for measuring where `pipeirc run`'s time to the first step goes.

With `PIPEIR_MILESTONES=FILE` in the environment, each of the run's processes (the launcher,
the preflight, every rank) appends one line per milestone it passes to FILE:
`<time.time()> <pid> <name>`. `bench/startup.py --breakdown` sets it and turns the lines into
the breakdown it prints. Unset, as normally, `mark` costs one environment lookup.
"""

from __future__ import annotations

import os
import time

#: the environment variable that names the file
ENV = "PIPEIR_MILESTONES"


def mark(name: str) -> None:
    """Record that this process passed `name` now (when `ENV` names a file)."""
    path = os.environ.get(ENV)
    if path:
        # one short write to a file opened for appending: lines of processes never interleave
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{time.time():.6f} {os.getpid()} {name}\n")
