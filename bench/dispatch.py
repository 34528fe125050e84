"""The rank file's own cost per instruction: its table interpreter against the straight-line
form (`--emit unrolled`), both calling a context whose methods do nothing, so the difference
is the dispatch alone (what `python bench/runtime.py --mode noop` counts in pipeir's added cost
per instruction, without the runtime's own work).

    python bench/dispatch.py [--ranks 1] [--microbatches 16] [--v 4] [--repeats 200]

Interleaved 1F1B with overlap (posts, batches and waits included); medians of --repeats steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import pipeir
from pipeir.backend.codegen import rank_source, unrolled_source
from pipeir.backend.table import CALLS, rank_table


class NoopContext:
    """Every `Context` method the programs call, doing nothing (a batch returns handles)."""

    def batch(self, *posts: Any) -> list[None]:
        return [None] * len(posts)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


for _name in CALLS:
    if _name != "batch":
        setattr(NoopContext, _name, staticmethod(_noop))


def _step(source: str) -> Callable[..., None]:
    ns: dict[str, Any] = {}
    exec(compile(source, "<rank>", "exec"), ns)
    fn: Callable[..., None] = ns["step"]
    return fn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--v", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=200)
    args = ap.parse_args()
    low = pipeir.compile(pipeir.library.get("interleaved-1f1b", args.ranks, args.microbatches,
                                            v=args.v), "overlap").lowered
    table = rank_table(low, 0)
    interp, straight = _step(rank_source(low, 0)), _step(unrolled_source(low, 0))
    ctx, n = NoopContext(), len(table)
    got: dict[str, list[float]] = {"table": [], "straight": []}
    for _ in range(args.repeats):  # alternating, so both see the same machine
        t0 = time.perf_counter()
        interp(ctx, table)
        t1 = time.perf_counter()
        straight(ctx)
        t2 = time.perf_counter()
        got["table"].append((t1 - t0) / n)
        got["straight"].append((t2 - t1) / n)
    tab, st = (1e9 * statistics.median(got[k]) for k in ("table", "straight"))
    print(f"rank 0: {n} instructions per step; medians of {args.repeats} steps")
    print(f"table interpreter: {tab:6.0f} ns per instruction")
    print(f"straight-line:     {st:6.0f} ns per instruction")
    print(f"interpreter's own cost: {tab - st:+.0f} ns per instruction ({tab / st:.2f}x)")


if __name__ == "__main__":
    main()
