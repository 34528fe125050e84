"""Where rank processes come from: a fork server that has imported the worker once.

NOTE (start-up): a rank forked from a fork server that has already imported torch, the
worker and `torch._dynamo` (which any torch optimizer imports when it is built) starts at
once; a fresh interpreter spends seconds on those imports, once per rank. The fork server
is started by `prestart()` as early as the launcher knows it will launch (before it compiles
the schedule), so its imports run while the launcher does that work, and `launch` forks every
rank from it. The model check before the launch (`pipeirc run`'s preflight, which traces the
model with torch) runs in a process forked from it too (`pipeir.runtime.forked`), so the
launcher never imports torch: on a machine whose cores are busy, every import of torch is
seconds that the ranks wait for. This module imports nothing heavy, so calling `prestart()`
costs the launcher nothing.

Where the fork server is not available (not POSIX), ranks are spawned: each imports what it
needs itself, and the launcher checks the model in its own process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import forkserver
from typing import Any

#: what the fork server imports before it forks a rank or the preflight: the worker, the
#: preflight and `torch._dynamo` (see the NOTE), with the garbage collector off
PRELOAD = ["pipeir.runtime.preload"]


def context() -> Any:
    """The multiprocessing context ranks are started with."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def under_torchrun() -> bool:
    """Whether torchrun started this process (as one rank): then it starts no ranks."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def prestart() -> bool:
    """Start the fork server now (it imports `PRELOAD` in the background), unless it already
    runs; whether there is one (False: not POSIX, ranks are spawned)."""
    if context().get_start_method() != "forkserver":
        return False
    forkserver.ensure_running()
    return True
