"""Pause Python's cyclic garbage collector around bulk graph construction.

NOTE: building a 65k-op schedule allocates ~10^6 small objects and no reference cycles; the
collector's generation-0 passes over them cost ~40% of build time (bench/compile_scale.py).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
