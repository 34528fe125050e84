"""pipeirc bubble: analytic and simulated bubble side by side, to check one against the other.

Simulations use uniform costs (F = 1, B = 2, so I = W = 1 for zero-bubble schedules) and
free communication; schedules with a chunks parameter v use chunks of cost 1/v, the
assumption under the closed form (p - 1) / (v m + p - 1). ZB-V and DualPipeV run two chunks
per rank at full cost each (the bubble fraction does not depend on the scale).
"""

from __future__ import annotations

import argparse
import math

from pipeir import driver, library
from pipeir.cli.common import positive_ints
from pipeir.diagnostics import EXIT_INVALID, EXIT_OK, PipeirError, UsageError
from pipeir.sim import CostModel
from pipeir.sim.analytic import analytic

#: The library schedules in the default table, classic first.
_DEFAULT = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb-h1", "zb-h2", "zb-v",
            "dualpipe-v")

ORDER = 60
NAME = "bubble"
HELP = "table of analytic vs simulated bubble for library schedules (uniform costs)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schedule", default=",".join(_DEFAULT), metavar="NAMES",
                   help="comma-separated library schedules (default: %(default)s)")
    p.add_argument("--ranks", default="4,8", metavar="P,...", help="default: %(default)s")
    p.add_argument("--microbatches", default="8,16,32", metavar="M,...",
                   help="default: %(default)s")
    p.add_argument("--v", default=None, metavar="V,...",
                   help="chunks per rank, for schedules that take v (default: 2)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")


def run(args: argparse.Namespace) -> int:
    names = []
    for raw in args.schedule.split(","):
        name = library.canonical_name(raw.strip())
        if name is None:
            raise library.unknown_schedule(raw.strip())
        names.append(name)
    ranks = positive_ints("--ranks", args.ranks)
    mbs = positive_ints("--microbatches", args.microbatches)
    vs = positive_ints("--v", args.v or "2")
    if args.v is not None and not any("v" in library.params(n) for n in names):
        raise UsageError(f"--v: {', '.join(names)} take{'s' if len(names) == 1 else ''} no "
                         "chunks parameter v")
    head = ["schedule", "p", "m", "v", "analytic", "simulated", "peak act", "agree"]
    rows: list[list[str]] = []
    skipped: list[str] = []
    reasons: dict[str, None] = {}  # footnotes for rows without a closed form, in order
    bad = 0
    for name in names:
        takes_v = "v" in library.params(name)
        for p in ranks:
            for m in mbs:
                for v in vs if takes_v else [1]:
                    row, why = _row(name, p, m, v, takes_v)
                    if row is not None and why:
                        reasons[why] = None
                    elif row is None:
                        skipped.append(f"{name} p={p} m={m}" + (f" v={v}" if takes_v else "")
                                       + f": {why}")
                        continue
                    bad += row[-1] == "NO"
                    rows.append(row)
    if not rows:
        more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
        raise UsageError(f"nothing to tabulate: {skipped[0]}{more}")
    print(_table(head, rows, args.markdown))
    for why in reasons:
        print(f"n/a: {why}")
    for line in skipped:
        print(f"skipped {line}")
    if bad:
        print(f"{bad} row(s) disagree with the formula")
    return EXIT_INVALID if bad else EXIT_OK


def _row(name: str, p: int, m: int, v: int, takes_v: bool) -> tuple[list[str] | None, str]:
    ref = driver.ScheduleRef(library=name, ranks=p, microbatches=m, v=v if takes_v else None)
    try:
        elab = driver.load_schedules(ref)[0]
    except PipeirError as e:
        return None, f"not defined at these sizes ({e.message})"
    result = driver.simulate(driver.Loaded(elab, CostModel(F=1.0 / v, B=2.0 / v)))
    theory = analytic(name, p, m, v)
    peak = max(result.peak_activations)
    if theory.bubble is None:
        agree = "-"
        shown = "n/a"
    else:
        ok = math.isclose(theory.bubble, result.bubble, rel_tol=1e-9, abs_tol=1e-12)
        if theory.peak_activations is not None:
            ok = ok and peak == theory.peak_activations
        agree = "yes" if ok else "NO"
        shown = f"{theory.bubble:.2%}"
    peak_text = str(peak) if theory.peak_activations is None else \
        f"{peak} ({theory.peak_activations})"
    return [name, str(p), str(m), str(v) if takes_v else "-", shown, f"{result.bubble:.2%}",
            peak_text, agree], theory.reason


def _table(head: list[str], rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(head) + " |",
                 "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in [head, *rows])
