"""The launcher owns its workers: however `pipeirc run` dies, no rank, fork server or
resource tracker outlives it (issue 11). The run is started in its own session by
bench/abuse.py's runner, killed once it trains, and every process of that session must be
gone within 5 s (found by scanning /proc, so no psutil is needed)."""

from __future__ import annotations

import importlib.util
import signal
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).parent.parent

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _abuse() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pipeir_abuse", REPO / "bench/abuse.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.mp
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_killing_the_launcher_leaves_no_process(sig: signal.Signals) -> None:
    abuse = _abuse()
    case = next(c for c in abuse.runtime_cases() if c.kill is not None and c.kill[0] == sig)
    assert case.kill[1].startswith("step    2/")  # killed while training, all ranks up
    with tempfile.TemporaryDirectory() as root:
        outcome = abuse.run_case(case, Path(root))
    assert outcome.code == -sig
    assert outcome.problems == {}  # no orphan (nor hang, traceback or touched file)
