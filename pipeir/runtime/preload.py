"""What the fork server imports before it forks a rank or the preflight, with Python's cyclic
garbage collector off.

NOTE (start-up): importing torch and `torch._dynamo` (which any torch optimizer imports when
it is built; see `pipeir.runtime.forkserver`) allocates a few hundred thousand objects and
no garbage worth collecting; the collector's passes over them are a quarter of the import
(measured: 1.53 s with it off against 1.98 s on, torch 2.13, idle 2-core machine), and the
import is the longest part of `pipeirc run`'s time to its first step. Afterwards the imported
objects are frozen out of collection, so that no child's collection walks them (nor touches
the pages it shares with the fork server), and the collector stays off in the fork server,
which only forks: each child turns it back on (`pipeir.runtime.launch`'s worker entry). Only
the fork server imports this module (`forkserver.PRELOAD`).
"""

import gc
from importlib import import_module

gc.disable()

try:  # in this order: the fork server skips a preload that fails, keeping what came before
    for name in ("pipeir.runtime.worker", "pipeir.runtime.preflight", "torch._dynamo"):
        import_module(name)
finally:
    gc.freeze()
