"""Optional extras: without OR-Tools (`pip install 'pipeir[synth]'`) synthesis says in one
line what to install, through every door, and everything else still works.

The missing package is faked the way Python itself reports one: `sys.modules["ortools"] =
None` makes every `import ortools...` raise ImportError. The modules that already imported
it are taken out of `sys.modules` for the test (monkeypatch puts them back), so they import
again and meet the missing package."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import pipeir
from pipeir.diagnostics import UsageError

Cli = Callable[..., tuple[int, str, str]]
NEEDS = "synthesis needs OR-Tools, which is not installed: pip install 'pipeir[synth]'"


@pytest.fixture
def no_ortools(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(sys.modules):
        if name.split(".")[0] == "ortools" or name.startswith("pipeir.search.synth"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "ortools", None)


def _one_line(code: int, out: str, err: str, where: str = "") -> None:
    """One diagnostic naming the extra (`where` is its place, as for any pass error)."""
    assert (code, out) == (2, ""), err
    assert "Traceback" not in err and err.count("error: ") == 1, err
    assert err.splitlines()[0] == f"{where}error: {NEEDS}", err


@pytest.mark.usefixtures("no_ortools")
def test_synth_command_names_the_extra(cli: Cli, tmp_path: Path) -> None:
    costs = tmp_path / "costs.toml"
    costs.write_text("F = 1.0\nB = 2.0\n")
    _one_line(*cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4))


@pytest.mark.usefixtures("no_ortools")
def test_synth_pass_names_the_extra(cli: Cli) -> None:
    _one_line(*cli("opt", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                   "--passes", "synth"), where="<passes>:1:1: ")
    with pytest.raises(UsageError, match=r"pip install 'pipeir\[synth\]'"):
        pipeir.compile(pipeir.library.get("1f1b", 2, 4), "synth")


@pytest.mark.usefixtures("no_ortools")
def test_everything_else_works_without_it(cli: Cli, tmp_path: Path) -> None:
    code, out, err = cli("passes")
    assert code == 0 and "synth" in out, err  # the pass is listed: its class needs no solver
    code, out, err = cli("opt", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "4",
                         "--passes", "split-backward,reorder")
    assert code == 0, err
    costs = tmp_path / "costs.toml"
    costs.write_text("F = 1.0\nB = 2.0\n")
    code, out, err = cli("tune", "--costs", costs, "--ranks", "2", "--microbatches", "4")
    assert code == 0, err
    assert not any(name.split(".")[0] == "ortools" and mod is not None
                   for name, mod in sys.modules.items())
