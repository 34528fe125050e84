"""Where rank processes come from: a fork server that has imported the worker once.

NOTE (start-up): a rank forked from a fork server that has already imported torch, the
worker and `torch._dynamo` (which any torch optimizer imports when it is built) starts at
once; a fresh interpreter spends seconds on those imports, once per rank. The fork server
is started by `prestart()` as early as the launcher knows it will launch (before it imports
torch itself, compiles and checks the model), so its imports run while the launcher does
that work, and `launch` forks every rank from it. This module imports nothing heavy, so
calling `prestart()` costs the launcher nothing.

Where the fork server is not available (not POSIX), ranks are spawned: each imports what it
needs itself.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver
from typing import Any

#: what the fork server imports before it forks a rank (`torch._dynamo`: see the NOTE)
PRELOAD = ["pipeir.runtime.worker", "torch._dynamo"]


def context() -> Any:
    """The multiprocessing context ranks are started with."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def prestart() -> None:
    """Start the fork server now (it imports `PRELOAD` in the background); a no-op where
    there is none or it already runs."""
    if context().get_start_method() == "forkserver":
        forkserver.ensure_running()
