"""The two front doors through the one driver: time `pipeirc compile --emit json` (in
process) against `pipeir.compile` + `dumps` on the same schedule, passes, costs and replicas,
and check on the way that both print the same programs.

    python bench/front_doors.py [--repeat 5]

Prints, per case, the median seconds of each door and their ratio (CLI / API). The CLI door
also reads the cost file and writes the JSON to a captured stdout; the API door is given the
schedule and the cost model already built, so the ratio is what loading and printing add
around the shared driver.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pipeir
from pipeir.backend.program_io import dumps
from pipeir.cli import main
from pipeir.sim import CostModel

COSTS = Path(__file__).resolve().parent.parent / "examples" / "costs" / "heavy-ends.toml"

#: (label, library name, ranks, micro-batches, passes, dp)
CASES = [
    ("1f1b p4 m32", "1f1b", 4, 32, "", 1),
    ("1f1b p4 m32 overlap dp2", "1f1b", 4, 32, "overlap", 2),
    ("zb-h1 p4 m64 reorder", "zb-h1", 4, 64, "reorder,overlap", 1),
    ("1f1b p4 m32 interleave{v=2} dp2", "1f1b", 4, 32, "interleave{v=2},split-backward", 2),
]


def _cli(name: str, p: int, m: int, passes: str, dp: int) -> str:
    words = ["compile", "--schedule", name, "--ranks", str(p), "--microbatches", str(m),
             "--costs", str(COSTS), "--dp", str(dp), "--emit", "json"]
    words += ["--passes", passes] if passes else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(words)
    assert code == 0, words
    return out.getvalue()


def _api(name: str, p: int, m: int, passes: str, dp: int, costs: CostModel) -> str:
    s = pipeir.library.get(name, ranks=p, microbatches=m)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return dumps(pipeir.compile(s, passes, costs=costs, dp=dp).lowered)


def _median(f: Callable[[], str], repeat: int) -> tuple[float, str]:
    times, out = [], ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    costs = CostModel.load(COSTS)
    print(f"{'case':<34} {'CLI s':>8} {'API s':>8} {'CLI/API':>8}  same")
    for label, name, p, m, passes, dp in CASES:
        t_cli, out_cli = _median(partial(_cli, name, p, m, passes, dp), args.repeat)
        t_api, out_api = _median(partial(_api, name, p, m, passes, dp, costs), args.repeat)
        print(f"{label:<34} {t_cli:8.3f} {t_api:8.3f} {t_cli / t_api:8.2f}  "
              f"{'yes' if out_cli == out_api else 'NO'}")


if __name__ == "__main__":
    main_()
