"""The launcher owns its workers: however `pipeirc run` dies, no rank, fork server or
resource tracker outlives it (issue 11). Processes are found by scanning /proc, so the test
needs no psutil."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).parent.parent

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _table() -> dict[int, tuple[int, str, int]]:
    """pid -> (parent pid, state, start time) for every process we can see."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        out[int(entry)] = (int(fields[1]), fields[0], int(fields[19]))
    return out


def descendants(pid: int) -> dict[int, int]:
    """Every process below `pid`, as pid -> start time (to tell a reused pid apart)."""
    table = _table()
    found: dict[int, int] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _, start) in table.items():
            if ppid == parent and child not in found:
                found[child] = start
                frontier.append(child)
    return found


def alive(procs: dict[int, int]) -> list[int]:
    table = _table()
    return [p for p, start in procs.items()
            if p in table and table[p][2] == start and table[p][1] != "Z"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_launcher_leaves_no_process(sig: signal.Signals) -> None:
    p = subprocess.Popen([sys.executable, "-m", "pipeir", "run", "examples/1f1b.sched",
                          "--set", "ranks=2", "--set", "microbatches=2", "--steps", "100000"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    procs: dict[int, int] = {}
    try:
        assert p.stdout is not None
        deadline = time.monotonic() + 120
        for line in p.stdout:  # wait until it trains: every worker exists by then
            if line.startswith("step") and line.split()[1] == "2/100000":
                break
            assert time.monotonic() < deadline, "the run did not start training"
        procs = descendants(p.pid)
        assert len(procs) >= 3  # two ranks and the fork server (and the resource tracker)
        os.kill(p.pid, sig)
        p.wait(10)
        end = time.monotonic() + 10
        while alive(procs) and time.monotonic() < end:
            time.sleep(0.1)
        left = alive(procs)
        assert not left, f"left behind after {sig.name}: " + "; ".join(
            Path(f"/proc/{q}/cmdline").read_text().replace("\0", " ")[:120] for q in left)
    finally:
        for q in alive(procs):  # only the processes this test started
            os.kill(q, signal.SIGKILL)
        if p.poll() is None:
            p.kill()
            p.wait()
