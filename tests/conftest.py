"""Shared test fixtures: golden files (with --update-goldens), hypothesis profiles, and the
guard that keeps process-starting tests under the `mp` marker.

The markers (registered in pyproject.toml; the default run deselects all but `smoke`):

    mp      starts training processes (multiprocessing, torchrun) or a gloo process group
    smoke   a small multi-process check kept in the default run (also marked `mp`)
    solver  CP-SAT solves and long synthesis searches
    abuse   the abuse suite (hostile inputs at scale)
    slow    a long single-process check (mypy over the package, ...)

`python -m pytest -q tests` runs the rest; `-m "mp or solver or abuse or slow"` the others.
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from pipeir.runtime import forkserver

GOLDEN_DIR = Path(__file__).parent / "golden"
REPO = Path(__file__).parent.parent

settings.register_profile("default", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-goldens", action="store_true",
                     help="rewrite golden files from the current output")


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Callable[[str, str], None]:
    """`golden("area/name.expected", text)`: compare with the file, or rewrite it."""
    update = request.config.getoption("--update-goldens")

    def check(name: str, text: str) -> None:
        path = GOLDEN_DIR / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        assert path.exists(), f"missing golden file {path}; run pytest --update-goldens"
        assert text == path.read_text(encoding="utf-8"), f"output differs from {path}"

    return check


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run `pipeirc ARGS...` in-process: returns (exit code, stdout, stderr)."""
    from pipeir.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(autouse=True)
def _processes_need_the_mp_marker(request: pytest.FixtureRequest,
                                  monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test that starts training processes, torchrun or a process group must say so with
    `@pytest.mark.mp`, or the default run would silently grow by minutes: unmarked, it fails
    at the start with the marker to add."""
    if request.node.get_closest_marker("mp") is not None:
        yield
        return
    name = request.node.nodeid

    def refuse(what: str) -> AssertionError:
        return AssertionError(f"{name} {what}: mark it @pytest.mark.mp (tests/conftest.py)")

    def start(self: multiprocessing.process.BaseProcess) -> None:
        raise refuse("starts a process")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    popen_init = subprocess.Popen.__init__

    def popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
        if any(w in str(args) for w in ("torch.distributed.run", "torchrun")):
            raise refuse("starts torchrun")
        popen_init(self, args, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", popen)
    # `pipeirc run` starts the ranks' fork server early (pipeir.runtime.forkserver); a test
    # that never launches has no use for it (it would import torch in the background), and
    # without one `pipeirc run` checks the model in its own process, not a forked one
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", lambda: None)
    monkeypatch.setattr(forkserver, "prestart", lambda: False)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "init_process_group"):
        def group(*args: Any, **kw: Any) -> None:
            raise refuse("makes a process group")

        monkeypatch.setattr(dist, "init_process_group", group)
    yield
