"""The fast subset of bench/abuse.py (issue 11): every writer against a FIFO, /dev/full,
/dev/stdout and /proc, the bad options the issue lists, and a few generated inputs, each as
a `pipeirc` subprocess: no traceback, hang, orphan, lost or stray file, and a one-line
`error:` for every bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.abuse

REPO = Path(__file__).parent.parent


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_abuse_quick_subset() -> None:
    r = subprocess.run([sys.executable, str(REPO / "bench/abuse.py"), "--quick", "--jobs", "2"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    counts = dict(line.split(":", 1) for line in r.stdout.splitlines()[1:7])
    assert {k: int(v) for k, v in counts.items()} == {
        "tracebacks": 0, "hangs": 0, "orphans": 0, "files lost": 0, "unclear outcomes": 0,
        "stray files": 0}
    assert int(r.stdout.split()[2]) >= 50  # inputs tried
