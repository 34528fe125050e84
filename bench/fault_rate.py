"""How many broken torch schedule CSVs `pipeirc check` catches, and how many good ones it
refuses (issue 12):

    python bench/fault_rate.py [--by operator|class|format]

The corpus is `tests/fixtures/torch_corpus.py`: every file torch writes for GPipe, 1F1B,
Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble and DualPipeV (compute_only
and compute_comms, p in {2, 4}) and seeded one-change mutants of them. Truth is the
independent oracle (`tests/fixtures/torch_oracle.py`, an event simulation of torch's
runtime) for the whole corpus, and torch's real `_PipelineScheduleRuntime` on gloo for the
stored sample (`tests/fixtures/torch_labels.json`). "caught / invalid" counts the files torch
fails on that pipeir rejects; "false alarms / valid" the files torch runs correctly that
pipeir rejects; "tracebacks" any other exception than a diagnostic.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))


def _pipeir(text: str, microbatches: int, tmp: Path, n: int) -> str:
    """"ok", "rejected" (a diagnostic) or "traceback"."""
    from pipeir.diagnostics import PipeirError
    from pipeir.interop.check import check_csv

    path = tmp / f"f{n}.csv"
    path.write_text(text)
    try:
        check_csv(str(path), microbatches=microbatches)
    except PipeirError:
        return "rejected"
    except Exception:  # a bug: counted, not hidden
        return "traceback"
    return "ok"


def _row(name: str, tally: Counter[str]) -> str:
    inv, val = tally["invalid"], tally["valid"]
    return (f"| {name} | {tally['caught']}/{inv} | {tally['alarm']}/{val} | "
            f"{tally['traceback']} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--by", choices=("operator", "class", "format"), default="operator")
    args = ap.parse_args(argv)
    from fixtures.torch_corpus import corpus
    from fixtures.torch_oracle import run as oracle

    t0 = time.perf_counter()
    entries = corpus()
    total: Counter[str] = Counter()
    groups: dict[str, Counter[str]] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for n, e in enumerate(entries):
            valid = oracle(e.text, e.format, e.ranks, e.stages, e.microbatches)[0] == "ok"
            got = _pipeir(e.text, e.microbatches, tmp, n)
            key = {"operator": e.mutation.split(" ")[0] if e.mutation else "(torch's file)",
                   "class": e.torch_class, "format": e.format}[args.by]
            for tally in (total, groups.setdefault(key, Counter())):
                tally["valid" if valid else "invalid"] += 1
                tally["caught"] += not valid and got != "ok"
                tally["alarm"] += valid and got != "ok"
                tally["traceback"] += got == "traceback"
        labels = json.loads((TESTS / "fixtures" / "torch_labels.json").read_text())
        live: Counter[str] = Counter()
        for n, lb in enumerate(labels["labels"]):
            valid = lb["verdict"] == "ok"
            got = _pipeir(lb["text"], lb["microbatches"], tmp, n)
            oracle_ok = oracle(lb["text"], lb["format"], lb["ranks"], lb["stages"],
                               lb["microbatches"])[0] == "ok"
            live["valid" if valid else "invalid"] += 1
            live["caught"] += not valid and got != "ok"
            live["alarm"] += valid and got != "ok"
            live["traceback"] += got == "traceback"
            live["oracle agrees"] += oracle_ok == valid
    print(f"corpus: {len(entries)} files ({total['invalid']} invalid, {total['valid']} valid by "
          f"the oracle); torch-labelled sample: {len(labels['labels'])} files "
          f"(torch {labels['torch']}, gloo, {labels['steps']} steps)\n")
    print(f"| {args.by} | caught / invalid | false alarms / valid | tracebacks |")
    print("|---|---:|---:|---:|")
    for key in sorted(groups):
        print(_row(key, groups[key]))
    print(_row("**whole corpus (oracle)**", total))
    print(_row("**torch-labelled sample**", live))
    print(f"\noracle agrees with torch on {live['oracle agrees']}/{len(labels['labels'])} "
          f"labelled files; {time.perf_counter() - t0:.1f} s")
    bad = total["invalid"] - total["caught"] + total["alarm"] + total["traceback"]
    bad += live["invalid"] - live["caught"] + live["alarm"] + live["traceback"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
